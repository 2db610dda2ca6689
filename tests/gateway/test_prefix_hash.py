"""The affinity key of `routing: prefix_affinity`: stable across turns, apart across conversations."""

from __future__ import annotations

from typing import Any

from gateway.prefix_hash import affinity_key, block_hashes, leading_text, session_key

SYSTEM = "You are a careful coding agent. " * 40


def key(body: dict[str, Any], session_id: str | None = None, **options: Any) -> bytes:
    return affinity_key(body, session_id, **{"block_chars": 64, "max_blocks": 16, **options})


def conversation(first: str, num_turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    for turn in range(num_turns - 1):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"more {turn}"}]
    return {"model": "m", "messages": messages}


def test_every_turn_of_a_conversation_has_its_first_turns_key() -> None:
    keys = {key(conversation("fix the build", turns)) for turns in range(1, 9)}
    assert len(keys) == 1


def test_conversations_that_share_the_system_prompt_get_different_keys() -> None:
    assert key(conversation("fix the build", 2)) != key(conversation("write the docs", 2))


def test_a_named_session_is_the_key_header_first() -> None:
    body = {**conversation("a", 1), "user": "u1", "prompt_cache_key": "p1"}
    assert session_key(body, "s1") == "s1"
    assert session_key(body, None) == "p1"
    assert session_key({**conversation("a", 1), "user": "u1"}, None) == "u1"
    assert session_key({"system": "x", "messages": [], "metadata": {"user_id": "anth"}}, None) == "anth"
    assert key(conversation("a", 1), "s1") == key(conversation("b", 3), "s1")
    assert key(conversation("a", 1), "s1", session_keys=False) != key(conversation("b", 3), "s1", session_keys=False)


def test_the_system_prompt_in_each_api_family() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    anthropic = {"system": [{"type": "text", "text": "S"}], "messages": [{"role": "user", "content": "U"}]}
    responses = {"instructions": "S", "input": "U"}
    assert leading_text(chat) == leading_text(anthropic) == leading_text(responses) == "system\nS\nuser\nU\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "image_url"}]}]}
    assert leading_text(parts) == "user\nU\n"
    assert leading_text({"prompt": "P"}) == "user\nP\n"


def test_only_the_leading_blocks_count() -> None:
    long_a = {"messages": [{"role": "user", "content": "x" * 10_000 + "a"}]}
    long_b = {"messages": [{"role": "user", "content": "x" * 10_000 + "b"}]}
    assert key(long_a) == key(long_b)  # past 16 blocks of 64 characters
    assert len(block_hashes("y" * 10_000, block_chars=64, max_blocks=16)) == 16
    assert (
        block_hashes("y" * 100, block_chars=64, max_blocks=16)[0]
        == block_hashes("y" * 64, block_chars=64, max_blocks=1)[0]
    )
