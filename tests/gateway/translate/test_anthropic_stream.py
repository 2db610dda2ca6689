"""Chat chunks → Anthropic stream events: exact sequences, tool-argument deltas, usage, failures mid-stream."""

from __future__ import annotations

from typing import Any

import orjson
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st
from translate_helpers import (
    SourceClosed,
    check_anthropic_events,
    chunk,
    collect,
    source,
    tool_delta,
    usage_chunk,
)

from backends.wire import parse_arguments
from gateway.errors import BackendError, UpstreamRateLimitedError
from gateway.translate import chat_chunks_to_events, chat_to_message

Events = list[tuple[str, dict[str, Any]]]


async def _events(chunks: list[dict[str, Any]], **options: Any) -> Events:
    events = await collect(chat_chunks_to_events(source(chunks), model="claude-x", **options))
    check_anthropic_events(events)
    return events


def _final_message(events: Events) -> dict[str, Any]:
    """The message the official SDK assembles from the events."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for _, data in events:
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=json_bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return snapshot.to_dict()  # type: ignore[no-any-return]


async def test_text_stream_has_the_exact_anthropic_sequence() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        usage_chunk(10, 2),
    ]
    events = await _events(chunks, input_tokens=9, message_id="msg_1")
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0][1]["message"] == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-x",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 0},
    }
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
    assert events[4][1] == {"type": "content_block_stop", "index": 0}
    assert events[5][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"input_tokens": 10, "output_tokens": 2},
    }
    assert _final_message(events)["content"] == [{"type": "text", "text": "Hello"}]


async def test_streamed_tool_argument_deltas() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "Checking."}),
        chunk(tool_delta(0, call_id="call_a", name="weather", arguments="")),
        chunk(tool_delta(0, arguments='{"ci')),
        chunk(tool_delta(0, arguments='ty": "Paris"}')),
        chunk(tool_delta(1, call_id="call_b", name="time", arguments='{"tz": "CET"}')),
        chunk({}, "tool_calls"),
        usage_chunk(30, 12),
    ]
    events = await _events(chunks)
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_a", "name": "weather", "input": {}},
        {"type": "tool_use", "id": "call_b", "name": "time", "input": {}},
    ]
    json_deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta" and d["index"] > 0]
    assert json_deltas == [  # each call's arguments collected, then sent as one JSON object
        (1, {"type": "input_json_delta", "partial_json": '{"city":"Paris"}'}),
        (2, {"type": "input_json_delta", "partial_json": '{"tz":"CET"}'}),
    ]
    final = _final_message(events)
    assert final["stop_reason"] == "tool_use"
    assert [block.get("input") for block in final["content"]] == [None, {"city": "Paris"}, {"tz": "CET"}]


async def test_stream_equals_the_non_streaming_translation() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "A"}),
        chunk({"content": "B"}),
        chunk(tool_delta(0, call_id="call_1", name="f", arguments='{"x": [1, 2]}')),
        chunk({}, "tool_calls"),
        usage_chunk(7, 3, cached_tokens=4),
    ]
    final = _final_message(await _events(chunks, message_id="msg_abc"))
    completion = {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "AB",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    expected = chat_to_message(completion, model="claude-x")
    assert {k: v for k, v in final.items() if v is not None} == {k: v for k, v in expected.items() if v is not None}


async def test_stop_reasons_in_message_delta() -> None:
    for finish_reason, extra, stop in [
        ("length", {}, ("max_tokens", None)),
        ("stop", {"stop_reason": "###"}, ("stop_sequence", "###")),
        ("stop", {}, ("end_turn", None)),
    ]:
        events = await _events([chunk({"content": "x"}), chunk({}, finish_reason, **extra)], stop_sequences=["###"])
        delta = next(data for name, data in events if name == "message_delta")["delta"]
        assert (delta["stop_reason"], delta["stop_sequence"]) == stop


async def test_no_usage_from_upstream_reports_the_estimate() -> None:
    events = await _events([chunk({"content": "x"}), chunk({}, "stop")], input_tokens=5)
    assert events[-2][1]["usage"] == {"input_tokens": 5, "output_tokens": 0}


async def test_failure_mid_block_closes_it_then_sends_an_error_event() -> None:
    closed = SourceClosed()
    error = BackendError("The upstream closed the connection in the middle of the stream. Retry the request.")
    chunks = source(
        [chunk({"content": "partial"}), chunk(tool_delta(0, call_id="c", name="f", arguments="{"))],
        error=error,
        closed=closed,
    )
    events = await collect(chat_chunks_to_events(chunks, model="m"))
    check_anthropic_events(events)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "error",
    ]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": error.message}}
    assert closed.is_closed


async def test_failure_before_any_content_and_error_type_mapping() -> None:
    error = UpstreamRateLimitedError("The upstream is rate limiting the gateway. Retry after 3 s.")
    events = await collect(chat_chunks_to_events(source([], error=error), model="m"))
    assert [name for name, _ in events] == ["message_start", "error"]
    assert events[-1][1]["error"]["type"] == "rate_limit_error"


async def test_unexpected_exceptions_do_not_leak_their_text() -> None:
    events = await collect(chat_chunks_to_events(source([], error=RuntimeError("secret-host:443 boom")), model="m"))
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "secret-host" not in events[-1][1]["error"]["message"]


async def test_closing_the_event_stream_early_closes_the_source() -> None:
    closed = SourceClosed()
    events = chat_chunks_to_events(source([chunk({"content": "a"}), chunk({"content": "b"})], closed=closed), model="m")
    assert (await anext(events))[0] == "message_start"
    assert (await anext(events))[0] == "content_block_start"
    await events.aclose()
    assert closed.is_closed


async def test_an_empty_stream_is_still_well_formed() -> None:
    events = await _events([chunk({}, "stop")])
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]


async def test_chunks_for_other_choices_are_ignored() -> None:
    events = await _events(
        [chunk({"content": "x"}), {**chunk({"content": "y"}), "choices": [{"index": 1, "delta": {"content": "y"}}]}]
    )
    assert _final_message(events)["content"] == [{"type": "text", "text": "x"}]


_piece = st.one_of(
    st.text(min_size=1, max_size=5).map(lambda text: ("text", text)),
    st.tuples(st.integers(0, 3), st.text(max_size=5)).map(lambda pair: ("tool", pair)),
)


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(_piece, max_size=25), finish_reason=st.sampled_from(["stop", "length", "tool_calls", None]))
async def test_any_chunk_sequence_gives_well_formed_events(
    pieces: list[tuple[str, Any]], finish_reason: str | None
) -> None:
    """Text and tool calls interleave freely, and so do the argument fragments of several calls; each tool call's
    block carries the object its fragments make (repaired as a non-streaming answer is)."""
    chunks: list[dict[str, Any]] = []
    fragments: list[str] = []  # per tool call, its arguments as sent
    for kind, value in pieces:
        if kind == "text":
            chunks.append(chunk({"content": value}))
        else:
            index, arguments = value
            if index >= len(fragments):
                index = len(fragments)
                chunks.append(chunk(tool_delta(index, call_id=f"call_{index}", name="f", arguments=arguments)))
                fragments.append(arguments)
            else:
                chunks.append(chunk(tool_delta(index, arguments=arguments)))
                fragments[index] += arguments
    chunks.append(chunk({}, finish_reason))
    events = await _events(chunks)
    assert events[0][0] == "message_start" and [name for name, _ in events[-2:]] == ["message_delta", "message_stop"]
    text = "".join(
        d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["delta"]["type"] == "text_delta"
    )
    assert text == "".join(value for kind, value in pieces if kind == "text")
    tool_blocks = [
        d["index"] for n, d in events if n == "content_block_start" and d["content_block"]["type"] == "tool_use"
    ]
    inputs = {
        d["index"]: orjson.loads(d["delta"]["partial_json"])
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    }
    assert [inputs.get(index, {}) for index in tool_blocks] == [parse_arguments(f) for f in fragments]
    assert orjson.dumps(events)  # every payload is JSON-serialisable as sent on the wire


async def test_broken_tool_arguments_stream_as_the_non_streaming_answer_repairs_them() -> None:
    """A small model's broken JSON (or an array) reaches an Anthropic client as `{"_raw_arguments": ...}`, as
    `messages.create` returns it, instead of fragments the SDK's stream helper fails to parse."""
    chunks = [
        chunk(tool_delta(0, call_id="call_a", name="f", arguments='{"a": 1,')),
        chunk(tool_delta(1, call_id="call_b", name="g", arguments="[1, 2]")),
        chunk(tool_delta(0, arguments=", oops")),  # interleaved: a late fragment of the first call
        chunk({}, "tool_calls"),
    ]
    final = _final_message(await _events(chunks))  # accumulated by the anthropic SDK's own code
    assert [block["input"] for block in final["content"]] == [
        {"_raw_arguments": '{"a": 1,, oops'},
        {"_raw_arguments": "[1, 2]"},
    ]
    assert final["stop_reason"] == "tool_use"
