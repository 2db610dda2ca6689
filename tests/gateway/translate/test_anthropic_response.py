"""Golden tests: chat completions → Anthropic Messages responses (blocks, stop reasons, usage)."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message

from gateway.translate import chat_to_message


def _completion(message: dict[str, Any], finish_reason: str | None = "stop", **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason, **extra}
    return {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "created": 1,
        "model": "upstream-model",
        "choices": [choice],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
    }


def test_text_response() -> None:
    message = chat_to_message(_completion({"content": "Hello!"}), model="claude-x")
    assert message == {
        "id": "msg_123",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [{"type": "text", "text": "Hello!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 5},
    }
    Message.model_validate(message)


def test_tool_calls_become_tool_use_blocks() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": ""}},
    ]
    message = chat_to_message(_completion({"content": "Let me check.", "tool_calls": calls}, "tool_calls"), model="m")
    assert message["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "time", "input": {}},
    ]
    assert message["stop_reason"] == "tool_use"
    Message.model_validate(message)


def test_broken_tool_arguments_are_kept_as_raw_text() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1'}}]
    message = chat_to_message(_completion({"content": None, "tool_calls": calls}, "tool_calls"), model="m")
    assert message["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {"_raw_arguments": '{"a": 1'}}]


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason"),
    [("stop", "end_turn"), (None, "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal")],
)
def test_stop_reasons(finish_reason: str | None, stop_reason: str) -> None:
    message = chat_to_message(_completion({"content": "x"}, finish_reason), model="m")
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, None)


def test_tool_calls_with_a_stop_finish_reason_are_still_tool_use() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert chat_to_message(_completion({"tool_calls": calls}, "stop"), model="m")["stop_reason"] == "tool_use"


def test_stop_sequence_reported_by_the_upstream() -> None:
    completion = _completion({"content": "x"}, "stop", stop_reason="END")
    message = chat_to_message(completion, model="m", stop_sequences=["END"])
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    # a stop token id (vLLM reports those too) or an unrequested string is a natural end
    completion = _completion({"content": "x"}, "stop", stop_reason=2)
    assert chat_to_message(completion, model="m", stop_sequences=["END"])["stop_reason"] == "end_turn"


def test_cached_prompt_tokens_are_counted_apart() -> None:
    completion = _completion({"content": "x"})
    completion["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
    assert chat_to_message(completion, model="m")["usage"] == {
        "input_tokens": 4,
        "output_tokens": 5,
        "cache_read_input_tokens": 8,
    }


def test_refusal_and_empty_answers() -> None:
    assert chat_to_message(_completion({"content": None, "refusal": "No."}), model="m")["content"] == [
        {"type": "text", "text": "No."}
    ]
    empty = chat_to_message(_completion({"content": ""}), model="m")
    assert empty["content"] == []
    Message.model_validate(empty)


def test_missing_usage_and_id() -> None:
    completion = _completion({"content": "x"})
    del completion["usage"], completion["id"]
    message = chat_to_message(completion, model="m")
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 0}
    assert message["id"].startswith("msg_")
