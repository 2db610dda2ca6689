"""Building blocks for translation tests: chat chunks, async sources that can fail, and SDK conformance checks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

_ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
_RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)


class SourceClosed:
    """Records whether a source's `finally` ran (closing it must settle usage and release the upstream)."""

    def __init__(self) -> None:
        self.is_closed = False


async def source(
    items: Iterable[dict[str, Any]], *, error: Exception | None = None, closed: SourceClosed | None = None
) -> AsyncIterator[dict[str, Any]]:
    try:
        for item in items:
            yield item
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.is_closed = True


async def collect(iterator: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in iterator]


def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None, **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "up",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason, **choice}],
    }


def usage_chunk(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "up",
        "choices": [],
        "usage": usage,
    }


def tool_delta(
    index: int, *, call_id: str | None = None, name: str | None = None, arguments: str = ""
) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def check_anthropic_events(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every event parses as the SDK's type, its SSE name equals its `type`, and blocks open/close in order."""
    open_index: int | None = None
    next_index = 0
    for name, data in events:
        assert name == data["type"]
        if name == "error":
            assert set(data) == {"type", "error"} and set(data["error"]) == {"type", "message"}
            continue
        _ANTHROPIC_EVENT.validate_python(data)
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index, next_index = None, next_index + 1
        elif name in ("message_delta", "message_stop"):
            assert open_index is None
    assert open_index is None, "a block was left open"


def check_responses_events(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Every event parses as the SDK's type, with its SSE name as `type` and consecutive sequence numbers."""
    for position, (name, data) in enumerate(events):
        assert name == data["type"]
        assert data["sequence_number"] == position
        _RESPONSES_EVENT.validate_python(data)
