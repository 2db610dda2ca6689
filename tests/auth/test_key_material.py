from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from auth.base import model_allowed
from auth.keys import display_prefix, generate_key, hash_key, is_key_id, new_key_id, new_request_id
from auth.master_key import master_key_path, read_master_key, resolve_master_key


def test_generated_keys_are_prefixed_random_and_long() -> None:
    keys = {generate_key() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert key.startswith("sk-ug-")
        assert len(key) >= len("sk-ug-") + 43


def test_hash_is_sha256_hex_and_prefix_reveals_four_chars() -> None:
    key = generate_key()
    assert len(hash_key(key)) == 64 and key not in hash_key(key)
    assert hash_key(key) == hash_key(key) != hash_key(generate_key())
    assert display_prefix(key) == key[:10] + "…"


def test_key_ids() -> None:
    assert is_key_id(new_key_id())
    assert not is_key_id("key_../../etc") and not is_key_id("master")


def test_model_allowlist_semantics_match_the_lua_matcher() -> None:
    assert model_allowed((), "anything")
    assert model_allowed(("openai/*",), "openai/gpt-4o")
    assert not model_allowed(("openai/*",), "openai")
    assert model_allowed(("gpt-4o-?ini",), "gpt-4o-mini")
    assert not model_allowed(("gpt-4o",), "gpt-4o-mini")


def test_master_key_generated_once_owner_only_and_printed_once(tmp_path: Path) -> None:
    announced: list[str] = []
    data_dir = tmp_path / "data"
    assert read_master_key(None, data_dir) is None
    key = resolve_master_key(None, data_dir, announce=lambda k, _: announced.append(k))
    again = resolve_master_key(None, data_dir, announce=lambda k, _: announced.append(k))
    assert key == again and key.startswith("sk-ug-")
    assert announced == [key]
    mode = stat.S_IMODE(master_key_path(tmp_path / "data").stat().st_mode)
    assert mode == 0o600


def test_configured_master_key_wins_and_writes_nothing(tmp_path: Path) -> None:
    configured = resolve_master_key("sk-ug-configured", tmp_path, announce=lambda *_: pytest.fail("printed"))
    assert configured == "sk-ug-configured"
    assert not master_key_path(tmp_path).exists()


def test_request_ids_are_unique_within_a_process_and_across_a_fork() -> None:
    ids = {new_request_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child draws a new prefix, so its ids cannot repeat the parent's
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child_id = os.read(read_end, 100).decode()
    parent_id = new_request_id()
    assert child_id not in ids and child_id != parent_id
    assert child_id[:16] != parent_id[:16]
