"""The weights cache: later loads read the converted checkpoint, equal to the first; entries are replaced safely."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from local_engine.loader import Checkpoint, load_checkpoint
from local_engine.weights_cache import MARKER_FILE, WeightsCache, cache_key

from .tiny_checkpoints import tiny_model


def assert_same_checkpoint(first: Checkpoint, second: Checkpoint) -> None:
    assert second.hf_config == first.hf_config
    assert set(second.state_dict) == set(first.state_dict)
    for name, tensor in first.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name
    for text in ("hi   hi 123", "x 2024-11-29  42", "<|im_start|>user\nhi<|im_end|>"):
        assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(messages) == first.tokenizer.apply_chat_template(messages)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    assert second.tokenizer.bos_token_id == first.tokenizer.bos_token_id


def test_bundled_cached_load_equals_first_load(
    bundled_first_load: Checkpoint, bundled_cached_load: Checkpoint, bundled_path: Path, session_cache_dir: Path
) -> None:
    assert bundled_first_load.from_cache is False
    assert bundled_cached_load.from_cache is True
    assert_same_checkpoint(bundled_first_load, bundled_cached_load)
    entry = session_cache_dir / cache_key(bundled_path)
    assert json.loads((entry / MARKER_FILE).read_text())["source"] == str(bundled_path.resolve())
    print(
        f"\nbundled SmolLM2-135M: first load {bundled_first_load.load_seconds:.1f} s, "
        f"cached load {bundled_cached_load.load_seconds:.1f} s"
    )


def test_tiny_gguf_round_trip_through_cache(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("qwen3"), "qwen3")
    cache_dir = tmp_path / "cache"
    first = load_checkpoint(source, cache_dir=cache_dir)
    second = load_checkpoint(source, cache_dir=cache_dir)
    assert (first.from_cache, second.from_cache) == (False, True)
    assert_same_checkpoint(first, second)
    assert [p.name for p in cache_dir.iterdir()] == [cache_key(source)]  # no staging directories left behind


def test_changed_source_gets_a_new_entry_and_the_old_one_goes(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("llama"), "llama")
    cache_dir = tmp_path / "cache"
    load_checkpoint(source, cache_dir=cache_dir)
    old_key = cache_key(source)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert cache_key(source) != old_key

    reloaded = load_checkpoint(source, cache_dir=cache_dir)

    assert reloaded.from_cache is False
    assert [p.name for p in cache_dir.iterdir()] == [cache_key(source)]


def test_corrupt_entry_is_rebuilt(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("llama"), "llama")
    cache_dir = tmp_path / "cache"
    first = load_checkpoint(source, cache_dir=cache_dir)
    weights = cache_dir / cache_key(source) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])

    rebuilt = load_checkpoint(source, cache_dir=cache_dir)
    assert rebuilt.from_cache is False
    again = load_checkpoint(source, cache_dir=cache_dir)
    assert again.from_cache is True
    assert_same_checkpoint(first, again)


def test_concurrent_writer_keeps_the_first_entry(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("llama"), "llama")
    cache_dir = tmp_path / "cache"
    checkpoint = load_checkpoint(source, cache_dir=cache_dir)
    cache = WeightsCache(cache_dir)
    entry = cache.lookup(source)
    assert entry is not None
    marker_before = (entry / MARKER_FILE).stat().st_mtime_ns

    # A second process that converted the same file meanwhile finds the entry taken and keeps it.
    assert cache.store(source, checkpoint.hf_config, checkpoint.state_dict, checkpoint.tokenizer) == entry
    assert (entry / MARKER_FILE).stat().st_mtime_ns == marker_before
    assert [p.name for p in cache_dir.iterdir()] == [entry.name]


def test_unwritable_cache_does_not_stop_loading(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("llama"), "llama")
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    checkpoint = load_checkpoint(source, cache_dir=blocked)
    assert checkpoint.from_cache is False
    assert "model.embed_tokens.weight" in checkpoint.state_dict
