"""The prompt bound (gateway/estimates.py `prompt_token_bound`): never below what any byte-level BPE can count."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.estimates import MESSAGE_OVERHEAD, estimate_prompt_tokens, prompt_token_bound


@given(st.lists(st.text(), min_size=1, max_size=5))
def test_the_bound_covers_every_byte_of_every_message_and_the_template(texts: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": text} for text in texts]}
    num_bytes = sum(len(text.encode()) + len(b"user") for text in texts)
    assert prompt_token_bound("chat/completions", body) == num_bytes + MESSAGE_OVERHEAD * (len(texts) + 1)


def test_cjk_is_bounded_by_its_bytes_where_the_character_estimate_is_ten_times_low() -> None:
    body = {"prompt": "漢字" * 750}  # 1,500 characters, 4,500 bytes
    assert prompt_token_bound("completions", body) >= 4500 > 10 * estimate_prompt_tokens("completions", body)


def test_tools_and_token_ids_count() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = prompt_token_bound("chat/completions", {"messages": [], "tools": tools})
    assert with_tools > prompt_token_bound("chat/completions", {"messages": []}) + 50
    assert prompt_token_bound("completions", {"prompt": [1, 2, 3]}) == 3 + MESSAGE_OVERHEAD
