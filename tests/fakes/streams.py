"""Stream building blocks for tests: async sources that can fail (and record that they were closed), collecting
an iterator, and OpenAI chat chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

__all__ = ["SourceClosed", "chunk", "collect", "source", "tool_delta", "usage_chunk"]


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
