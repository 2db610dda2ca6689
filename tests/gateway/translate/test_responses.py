"""OpenAI Responses ⇄ chat completions: requests, response objects and the streaming event protocol."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from translate_helpers import SourceClosed, check_responses_events, chunk, collect, source, tool_delta, usage_chunk

from gateway.errors import InvalidRequestError, LimitError
from gateway.translate import chat_chunks_to_response_events, chat_to_response, responses_to_chat
from gateway.translate.responses import response_object

_EVENT = TypeAdapter(ResponseStreamEvent)

FUNCTION_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
    "strict": False,
}


def test_string_input_and_instructions() -> None:
    chat = responses_to_chat({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 64})
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 64,
    }


def test_codex_style_history() -> None:
    """Codex resends everything: developer/user messages, reasoning, calls and their outputs."""
    body = {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "List files and show this"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "auto"},
                ],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command":["ls"]}'},
            {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": '{"command":["pwd"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "/w"}]},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [FUNCTION_TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
    }
    chat = responses_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "sandbox: read-only"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "List files and show this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            ],
        },
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
                {"id": "call_2", "type": "function", "function": {"name": "shell", "arguments": '{"command":["pwd"]}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "/w"},
        {"role": "user", "content": "thanks"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "parameters": FUNCTION_TOOL["parameters"],
                "description": "Run a command",
                "strict": False,
            },
        }
    ]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("auto", False)
    assert (chat["stream"], chat["stream_options"]) == (True, {"include_usage": True})
    assert not {"reasoning", "store", "include", "prompt_cache_key", "reasoning_effort"} & set(chat)


def test_a_call_without_preceding_assistant_text_opens_an_assistant_turn() -> None:
    chat = responses_to_chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
            ],
        }
    )
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_non_function_tools_are_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    tools = [
        {"type": "web_search"},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        {"type": "namespace", "name": "mcp", "tools": []},
        FUNCTION_TOOL,
    ]
    with caplog.at_level(logging.WARNING, logger="unigate.translate"):
        chat = responses_to_chat({"model": "m", "input": "x", "tools": tools})
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]
    assert "web_search" in caplog.text and "apply_patch" in caplog.text and "namespace" in caplog.text
    assert "tool of type 'web_search'" in caplog.text and "None" not in caplog.text  # a nameless tool: its type
    with caplog.at_level(logging.WARNING, logger="unigate.translate"):
        chat = responses_to_chat({"model": "m", "input": "x", "tools": tools[:1], "tool_choice": "required"})
    assert "tools" not in chat and "tool_choice" not in chat


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "shell"}, {"type": "function", "function": {"name": "shell"}}),
        ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "shell"}]}, "required"),
    ],
)
def test_tool_choice(tool_choice: Any, expected: Any) -> None:
    chat = responses_to_chat({"model": "m", "input": "x", "tools": [FUNCTION_TOOL], "tool_choice": tool_choice})
    assert chat["tool_choice"] == expected


def test_sampling_and_text_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = responses_to_chat(
        {
            "model": "m",
            "input": "x",
            "temperature": 0.2,
            "top_p": 0.8,
            "user": "u",
            "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
        }
    )
    assert chat["temperature"] == 0.2 and chat["top_p"] == 0.8 and chat["user"] == "u"
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "A", "schema": schema, "strict": True},
    }
    chat = responses_to_chat({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}})
    assert chat["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": ["x"]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ],
)
def test_invalid_requests(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        responses_to_chat({"model": "m", **body})
    assert caught.value.param == param


def _completion(message: dict[str, Any], finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": 7,
            "total_tokens": 27,
            "prompt_tokens_details": {"cached_tokens": 5},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
    }


def test_response_object() -> None:
    request = {
        "model": "codex-model",
        "input": "x",
        "instructions": "Be brief.",
        "tools": [FUNCTION_TOOL, {"type": "web_search"}],
    }
    calls = [{"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}}]
    completion = _completion({"content": "Listing.", "tool_calls": calls}, "tool_calls")
    response = chat_to_response(completion, request=request, response_id="resp_1", created_at=9)
    Response.model_validate(response)
    assert (response["id"], response["object"], response["status"], response["model"]) == (
        "resp_1",
        "response",
        "completed",
        "codex-model",
    )
    assert response["instructions"] == "Be brief." and response["tools"] == [FUNCTION_TOOL]
    message, call = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Listing.", "annotations": [], "logprobs": []}]
    assert {k: call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call",
        "call_id": "call_1",
        "name": "shell",
        "arguments": '{"command":["ls"]}',
        "status": "completed",
    }
    assert call["id"].startswith("fc_") and message["id"].startswith("msg_")
    assert response["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 5, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 27,
    }


def test_max_tokens_cut_makes_an_incomplete_response() -> None:
    response = chat_to_response(_completion({"content": "partial"}, "length"), request={"model": "m", "input": "x"})
    Response.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


Events = list[tuple[str, dict[str, Any]]]


async def _events(chunks: list[dict[str, Any]], request: dict[str, Any] | None = None) -> Events:
    request = request or {"model": "m", "input": "x", "tools": [FUNCTION_TOOL]}
    events = await collect(chat_chunks_to_response_events(source(chunks), request=request, response_id="resp_1"))
    check_responses_events(events)
    return events


def _sdk_final_response(events: Events, tools: list[dict[str, Any]]) -> Any:
    """Feed the events to the official SDK's stream state machine, which rejects protocol violations."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=tools, text_format=omit)  # type: ignore[arg-type]
    for _, data in events:
        state.handle_event(_EVENT.validate_python(data))
    return state._completed_response


async def test_text_stream_has_the_exact_event_sequence() -> None:
    events = await _events(
        [chunk({"role": "assistant", "content": "Hel"}), chunk({"content": "lo"}), chunk({}, "stop"), usage_chunk(9, 2)]
    )
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert events[6][1]["text"] == "Hello"
    completed = events[-1][1]["response"]
    assert completed["status"] == "completed" and completed["usage"]["input_tokens"] == 9
    assert completed["output"][0]["content"][0]["text"] == "Hello"
    final = _sdk_final_response(events, [FUNCTION_TOOL])
    assert final.output_text == "Hello"


async def test_function_call_stream_with_argument_deltas() -> None:
    events = await _events(
        [
            chunk({"role": "assistant", "content": "Running."}),
            chunk(tool_delta(0, call_id="call_1", name="shell", arguments="")),
            chunk(tool_delta(0, arguments='{"command":')),
            chunk(tool_delta(0, arguments='["ls"]}')),
            chunk(tool_delta(1, call_id="call_2", name="shell", arguments='{"command":["pwd"]}')),
            chunk({}, "tool_calls"),
            usage_chunk(30, 10),
        ]
    )
    names = [name for name, _ in events]
    assert names[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added = events[8][1]
    assert added["output_index"] == 1 and added["item"]["type"] == "function_call"
    assert (added["item"]["call_id"], added["item"]["name"], added["item"]["status"]) == (
        "call_1",
        "shell",
        "in_progress",
    )
    assert events[11][1]["arguments"] == '{"command":["ls"]}'
    final = _sdk_final_response(events, [FUNCTION_TOOL])
    assert [(item.type, getattr(item, "arguments", None)) for item in final.output] == [
        ("message", None),
        ("function_call", '{"command":["ls"]}'),
        ("function_call", '{"command":["pwd"]}'),
    ]


async def test_max_tokens_cut_still_completes() -> None:
    events = await _events([chunk({"content": "abc"}), chunk({}, "length")])
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["status"] == "incomplete"


async def test_failure_mid_stream_sends_response_failed_with_partial_output() -> None:
    closed = SourceClosed()
    error = LimitError("Rate limit reached for this key; retry in 2 s.")
    chunks = source([chunk({"content": "par"}), chunk({"content": "tial"})], error=error, closed=closed)
    events = await collect(chat_chunks_to_response_events(chunks, request={"model": "m", "input": "x"}))
    check_responses_events(events)
    assert events[-1][0] == "response.failed"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "rate_limit_exceeded", "message": error.message}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "partial"
    assert "response.completed" not in [name for name, _ in events]
    assert closed.is_closed


async def test_unexpected_failure_hides_details() -> None:
    events = await collect(
        chat_chunks_to_response_events(source([], error=KeyError("internal")), request={"model": "m"})
    )
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1][1]["response"]["error"]["code"] == "server_error"
    assert "internal" not in events[-1][1]["response"]["error"]["message"]


async def test_text_interleaved_with_a_call_is_kept() -> None:
    events = await _events(
        [
            chunk(tool_delta(0, call_id="c", name="shell", arguments='{"command":')),
            chunk({"content": "\n"}),
            chunk(tool_delta(0, arguments='["ls"]}')),
            chunk({}, "tool_calls"),
        ]
    )
    output = events[-1][1]["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "message"]
    assert output[0]["arguments"] == '{"command":["ls"]}' and output[1]["content"][0]["text"] == "\n"
    _sdk_final_response(events, [FUNCTION_TOOL])


@pytest.mark.parametrize("depth", [100, 124, 125, 126, 200])
def test_what_the_response_repeats_is_writable_or_refused_up_front(depth: int) -> None:
    """The Response object repeats `tools` (and `text`, ...), one level deeper in a stream's events: a schema
    nested so deep that it cannot be written there is a 400 naming it before anything runs, never a 500 after
    the model answered (and the key was charged)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": schema}]}
    try:
        responses_to_chat(body)
    except InvalidRequestError as error:
        assert (error.status_code, error.param) == (400, "tools")
        return
    frame = response_object(body, response_id="r", created_at=0, status="in_progress")
    assert orjson.dumps({"type": "response.created", "response": frame})
