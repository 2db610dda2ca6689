"""Helpers shared by the translators: ids, tool-argument parsing, chat usage, closing a source stream, the
per-request log of dropped items, and the 400s for request fields of the wrong type."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.wire import DropLog, aclose_source, content_text, dumps, new_id, parse_arguments, usage_count
from gateway.errors import InvalidRequestError

__all__ = [
    "DropLog",
    "Event",
    "Json",
    "TextHoldingBuilder",
    "aclose_source",
    "content_text",
    "dumps",
    "dumps_request",
    "new_id",
    "parse_arguments",
    "position_id",
    "translate_stream",
    "usage_counts",
    "wrong_type",
]

logger = logging.getLogger("unigate.translate")

Json = dict[str, Any]
Event = tuple[str, Json]  # (SSE event name, data)


class TextHoldingBuilder:
    """Base of the stream translators (chat chunks → Anthropic or Responses events), run by `translate_stream`.

    Their tool-call block (Anthropic) or item (Responses) cannot reopen: text that arrives while one is open waits
    in `pending_text`, and becomes its own block when the call closes. `feed` reads choice 0 of each chat chunk
    (n > 1 has no equivalent in either API) and records the usage, finish reason and matched stop; subclasses
    implement `start`, `fail`, `finish`, `_text` (which holds text while a call is open), `_tool_call` and `_close`
    (the open block)."""

    def __init__(self) -> None:
        self.pending_text = ""
        self.usage: Json | None = None
        self.finish_reason: Any = None
        self.matched_stop: Any = None  # the stop string or token id that ended the choice, when the upstream says

    def start(self) -> list[Event]:
        raise NotImplementedError

    def feed(self, chunk: Json) -> list[Event]:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events.extend(self._text(delta["content"]))
            for call in delta.get("tool_calls") or []:
                events.extend(self._tool_call(call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if choice.get("stop_reason") is not None:
                self.matched_stop = choice["stop_reason"]
        return events

    def fail(self, error: Exception) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _text(self, text: str) -> list[Event]:
        raise NotImplementedError

    def _tool_call(self, call: Json) -> list[Event]:
        raise NotImplementedError

    def _close(self) -> list[Event]:
        raise NotImplementedError

    def _close_all(self) -> list[Event]:
        """Close the open block, and the block of any text held back while a tool call was open."""
        events = self._close()
        if self.pending_text:
            text, self.pending_text = self.pending_text, ""
            events.extend(self._text(text))
            events.extend(self._close())
        return events


async def translate_stream(builder: TextHoldingBuilder, chunks: AsyncIterator[Json]) -> AsyncIterator[Event]:
    """Run a stream builder over chat chunks: its opening events, each chunk's events, then its closing events —
    or, when `chunks` raises, its failure events (the stream then ends there). The source is always closed."""
    for event in builder.start():
        yield event
    try:
        async for chunk in chunks:
            for event in builder.feed(chunk):
                yield event
    except Exception as error:
        for event in builder.fail(error):
            yield event
        return
    finally:
        await aclose_source(chunks)
    for event in builder.finish():
        yield event


def position_id(prefix: str, param: str) -> str:
    """An id for a request item the client sent without one, from its place in the request (`messages[3].content[1]`
    → `toolu_3_1`): every turn that resends the conversation gets the same id, so the prompt rendered from it stays
    the same (a prefix cache keeps matching), where a fresh random id would change it on every request."""
    return prefix + "_".join(re.findall(r"\d+", param))


def dumps_request(value: Any, *, param: str) -> str:
    """`dumps` for a value from the request: 400 naming `param` when it is nested deeper than orjson writes."""
    try:
        return dumps(value)
    except orjson.JSONEncodeError:
        raise InvalidRequestError(f"`{param}` is nested too deeply.", code="invalid_request", param=param) from None


def wrong_type(param: str, expected: str, value: Any) -> InvalidRequestError:
    """400 for a request field of the wrong type: `param` is its path (`messages[2].content[0].text`)."""
    got = "null" if value is None else type(value).__name__
    return InvalidRequestError(f"`{param}` must be {expected}, not {got}.", code="invalid_request", param=param)


def usage_counts(usage: Any) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_prompt_tokens) from a chat-completions `usage` object."""
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt, completion = usage_count(usage.get("prompt_tokens")), usage_count(usage.get("completion_tokens"))
    return prompt, completion, usage_count(cached)
