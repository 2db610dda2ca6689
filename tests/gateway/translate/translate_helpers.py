"""Building blocks for translation tests: SDK conformance checks, and (from `fakes.streams`) chat chunks and async
sources that can fail."""

from __future__ import annotations

from typing import Any

from anthropic.types import RawMessageStreamEvent
from fakes.streams import SourceClosed, chunk, collect, source, tool_delta, usage_chunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

__all__ = [
    "SourceClosed",
    "check_anthropic_events",
    "check_responses_events",
    "chunk",
    "collect",
    "source",
    "tool_delta",
    "usage_chunk",
]

_ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
_RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)


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
