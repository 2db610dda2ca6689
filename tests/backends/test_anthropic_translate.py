"""`backends.anthropic_translate`, for chat clients on `type: anthropic` upstreams: chat → Messages → chat (and a
round trip through the gateway's own Messages translation)."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from anthropic.types import MessageParam
from fakes.streams import SourceClosed, chunk, collect, source, tool_delta, usage_chunk
from pydantic import TypeAdapter

from backends.anthropic_translate import chat_to_messages, events_to_chat_chunks, message_to_chat
from gateway.errors import BackendError, InvalidRequestError, UpstreamRateLimitedError
from gateway.translate import chat_chunks_to_events

_MESSAGE_PARAMS = TypeAdapter(list[MessageParam])


def test_request_golden() -> None:
    body = {
        "model": "claude-x",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image, and the weather?"},
                    {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,QUJD"}},
                    {"type": "image_url", "image_url": {"url": "https://example.org/a.png", "detail": "high"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Rome"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21C"}]},
            {"role": "user", "content": "Thanks"},
        ],
        "max_completion_tokens": 50,
        "max_tokens": 99,
        "temperature": 1.7,
        "top_p": 0.5,
        "stop": "END",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u1",
    }
    request = chat_to_messages(body)
    assert request == {
        "model": "claude-x",
        "system": "Be brief.\n\nUse tools.",
        "max_tokens": 50,
        "temperature": 1.0,
        "top_p": 0.5,
        "stop_sequences": ["END"],
        "stream": True,
        "metadata": {"user_id": "u1"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image, and the weather?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.org/a.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18C"},
                    {"type": "tool_result", "tool_use_id": "call_2", "content": "21C"},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    }
    _MESSAGE_PARAMS.validate_python(request["messages"])


def test_defaults_and_empty_turns() -> None:
    request = chat_to_messages(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
        default_max_tokens=123,
    )
    assert request == {
        "model": "m",
        "max_tokens": 123,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    }


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        ("auto", None, {"type": "auto"}),
        ("required", None, {"type": "any"}),
        ("none", None, {"type": "none"}),
        ({"type": "function", "function": {"name": "f"}}, None, {"type": "tool", "name": "f"}),
        (None, False, {"type": "auto", "disable_parallel_tool_use": True}),
        ("required", False, {"type": "any", "disable_parallel_tool_use": True}),
        (None, None, None),
    ],
)
def test_tools_and_tool_choice(tool_choice: Any, parallel: bool | None, expected: dict[str, Any] | None) -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "description": "F", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g"}},
        {"type": "custom", "custom": {"name": "patch"}},
    ]
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    request = chat_to_messages(body)
    assert request["tools"] == [
        {"name": "f", "input_schema": {"type": "object"}, "description": "F"},
        {"name": "g", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert request.get("tool_choice") == expected


def test_unsupported_requests() -> None:
    with pytest.raises(InvalidRequestError, match="n > 1"):
        chat_to_messages({"model": "m", "messages": [], "n": 2})
    with pytest.raises(InvalidRequestError):
        chat_to_messages({"model": "m", "messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(InvalidRequestError):
        chat_to_messages({"model": "m", "messages": "hi"})


def _message(content: list[dict[str, Any]], stop_reason: str = "end_turn") -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-up",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 4,
            "cache_read_input_tokens": 6,
            "cache_creation_input_tokens": 2,
        },
    }


def test_response_golden() -> None:
    message = _message(
        [
            {"type": "thinking", "thinking": "...", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
        ],
        "tool_use",
    )
    assert message_to_chat(message, model="claude-x", created=5) == {
        "id": "msg_1",
        "object": "chat.completion",
        "created": 5,
        "model": "claude-x",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 18,
            "completion_tokens": 4,
            "total_tokens": 22,
            "prompt_tokens_details": {"cached_tokens": 6},
        },
    }


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
    ],
)
def test_finish_reasons(stop_reason: str, finish_reason: str) -> None:
    chat = message_to_chat(_message([{"type": "text", "text": "x"}], stop_reason), model="m")
    assert chat["choices"][0]["finish_reason"] == finish_reason


def test_tool_only_message_has_null_content() -> None:
    chat = message_to_chat(_message([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "tool_use"), model="m")
    assert chat["choices"][0]["message"]["content"] is None


def _anthropic_stream() -> list[dict[str, Any]]:
    return [
        {
            "type": "message_start",
            "message": {**_message([]), "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 1}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_9", "name": "f", "input": {}},
        },
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"a":'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": " 1}"}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    ]


async def test_event_stream_to_chunks() -> None:
    chunks = await collect(events_to_chat_chunks(source(_anthropic_stream()), model="m", created=1))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "toolu_9", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
        {},
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 10
    assert chunks[-1]["usage"]["completion_tokens"] == 9
    assert {c["id"] for c in chunks} == {"msg_1"} and {c["object"] for c in chunks} == {"chat.completion.chunk"}


@pytest.mark.parametrize(
    ("error_type", "error_class", "code", "status"),
    [
        ("overloaded_error", BackendError, "upstream_overloaded", 503),  # as the same answer before the stream
        ("rate_limit_error", UpstreamRateLimitedError, "upstream_rate_limited", 429),
        ("api_error", BackendError, "upstream_error", 502),
    ],
)
async def test_error_event_raises_and_closes_the_source(
    error_type: str, error_class: type[BackendError], code: str, status: int
) -> None:
    closed = SourceClosed()
    events = [*_anthropic_stream()[:4], {"type": "error", "error": {"type": error_type, "message": "Overloaded"}}]
    with pytest.raises(error_class, match="Overloaded") as raised:
        await collect(events_to_chat_chunks(source(events, closed=closed), model="m"))
    assert (raised.value.code, raised.value.status_code) == (code, status)
    assert closed.is_closed


async def test_a_truncated_stream_raises() -> None:
    with pytest.raises(BackendError, match="before message_stop"):
        await collect(events_to_chat_chunks(source(_anthropic_stream()[:5]), model="m"))


async def test_round_trip_chat_to_anthropic_events_and_back() -> None:
    """chat chunks → Anthropic events (Messages route) → chat chunks (anthropic upstream) keeps the content."""
    original = [
        chunk({"role": "assistant", "content": "Let "}),
        chunk({"content": "me."}),
        chunk(tool_delta(0, call_id="call_1", name="f", arguments='{"q": ')),
        chunk(tool_delta(0, arguments='"x"}')),
        chunk({}, "tool_calls"),
        usage_chunk(11, 6),
    ]
    events = chat_chunks_to_events(source(original), model="m")
    payloads = (data async for _, data in events)
    chunks = await collect(events_to_chat_chunks(payloads, model="m"))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    arguments = "".join(
        call["function"].get("arguments", "")
        for c in chunks
        if c["choices"]
        for call in c["choices"][0]["delta"].get("tool_calls", [])
    )
    assert (text, orjson.loads(arguments)) == ("Let me.", {"q": "x"})
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 6,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"content": 42}, "`content` is a int"),
        ({"content": ["hello"]}, "`content[0]` is a str"),
        ({"content": [{"type": "text", "text": 7}]}, "`content[0].text` is a int"),
        ({"content": [{"type": "tool_use", "id": "t", "name": ["f"], "input": {}}]}, "`content[0].name` is a list"),
        ([{"content": []}], "`the body` is a list"),
    ],
)
def test_a_wrong_shaped_message_is_the_upstreams_502_not_our_500(message: Any, says: str) -> None:
    with pytest.raises(BackendError, match=re.escape(says)) as raised:
        message_to_chat(message, model="m")
    assert raised.value.code == "upstream_malformed_response"


def test_garbage_usage_and_stop_reason_are_read_safely() -> None:
    message = {"content": [], "stop_reason": ["x"], "usage": {"input_tokens": "abc", "output_tokens": 2.5}}
    chat = message_to_chat(message, model="m")
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"]) == (0, 2)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "content_block_delta", "index": "zero", "delta": {"type": "text_delta", "text": "x"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}},
        {"type": "content_block_delta", "index": 0, "delta": "x"},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": [1]},
        ["not", "an", "event"],
    ],
)
async def test_a_wrong_shaped_stream_event_is_the_upstreams_502(bad: Any) -> None:
    closed = SourceClosed()
    events = [*_anthropic_stream()[:3], bad]
    with pytest.raises(BackendError) as raised:
        await collect(events_to_chat_chunks(source(events, closed=closed), model="m"))
    assert raised.value.code == "upstream_malformed_response" and closed.is_closed


def test_a_json_schema_becomes_structured_output_and_what_has_no_equivalent_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
    }
    assert chat_to_messages(body)["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    with caplog.at_level("WARNING", logger="unigate.translate"):
        request = chat_to_messages({**body, "response_format": {"type": "json_object"}, "seed": 7, "logprobs": True})
    assert "output_config" not in request and "seed" not in request
    [line] = [r.getMessage() for r in caplog.records]
    assert "response_format of type 'json_object'" in line and "'seed'" in line and "'logprobs'" in line
