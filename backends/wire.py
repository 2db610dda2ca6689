"""Small helpers for translating between wire formats inside backends: ids, JSON text, tool arguments, message
text, the per-request log of dropped items, and closing a source stream. The gateway's translators
(`gateway.translate.common`) use them too.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.base import Json

__all__ = [
    "DropLog",
    "aclose_source",
    "content_text",
    "dumps",
    "has_usage_count",
    "new_id",
    "parse_arguments",
    "usage_count",
]

logger = logging.getLogger("unigate.translate")


def new_id(prefix: str) -> str:
    """An id in the target API's style (`msg_…`, `toolu_…`, `call_…`, `chatcmpl-…`)."""
    return f"{prefix}{uuid.uuid4().hex}"


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


MAX_USAGE_COUNT = 2**40  # an upstream's usage figure is clamped to this (it cannot be trusted blindly)


def has_usage_count(usage: Json, names: tuple[str, ...]) -> bool:
    """Whether `usage` gives any of `names` as a number (not a string, a boolean or nothing)."""
    return any(isinstance(usage.get(n), int | float) and not isinstance(usage.get(n), bool) for n in names)


def usage_count(value: Any) -> int:
    """A token count from an upstream as a sane integer: negative, fractional, huge or non-numeric (a string, a
    boolean, NaN) → clamped, never an exception."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value or value <= 0:
        return 0
    return int(min(value, MAX_USAGE_COUNT))


class DropLog:
    """What one request's translation dropped because the target cannot carry it, logged as ONE warning line per
    request: a body of 30,000 unknown blocks writes one line, not 30,000. Kinds are caller input, so they are cut
    short and only the first few distinct ones are named."""

    _MAX_KINDS = 8
    _MAX_KIND_CHARS = 40

    def __init__(self, target: str) -> None:
        self.target = target
        self.counts: dict[str, int] = {}
        self.num_unnamed = 0

    def add(self, what: str, kind: Any, *, name: Any = None) -> None:
        key = f"{what} {self._show(kind)}" if name is None else f"{what} {self._show(kind)} named {self._show(name)}"
        if key in self.counts:
            self.counts[key] += 1
        elif len(self.counts) < self._MAX_KINDS:
            self.counts[key] = 1
        else:
            self.num_unnamed += 1

    def _show(self, value: Any) -> str:
        shown = repr(value)
        return shown if len(shown) <= self._MAX_KIND_CHARS else shown[: self._MAX_KIND_CHARS - 3] + "..."

    def log(self) -> None:
        if not self.counts:
            return
        items = ", ".join(f"{count} x {key}" for key, count in self.counts.items())
        if self.num_unnamed:
            items += f", {self.num_unnamed} more of other kinds"
        logger.warning("dropped what %s cannot carry: %s", self.target, items)


def parse_arguments(raw: Any) -> Json:
    """Tool-call arguments (a JSON string in chat completions) as the object Anthropic's `input` must be.

    Small models often emit broken JSON; rather than fail the whole response (or silently send `{}`, which hides
    the model's attempt), the raw text is kept under one key so the client's tool validation reports it.
    """
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    try:
        value = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        logger.warning("tool call arguments are not valid JSON; passing them on as raw text")
        return {"_raw_arguments": str(raw)}
    if isinstance(value, dict):
        return value
    return {"_raw_arguments": str(raw)}


def content_text(content: Any, *, separator: str = "\n") -> str:
    """The text of a string or a list of text-bearing parts/blocks (`text`, `input_text`, `output_text`, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return separator.join(texts)


async def aclose_source(source: AsyncIterator[Any]) -> None:
    """Close an upstream iterator we stopped reading, so its `finally` (usage settlement, socket) runs now."""
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
