"""Helpers shared by the translators: ids, tool-argument parsing, chat usage, closing a source stream."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

__all__ = ["Json", "aclose_source", "content_text", "dumps", "new_id", "parse_arguments", "usage_counts"]

Json = dict[str, Any]

logger = logging.getLogger("unigate.translate")


def new_id(prefix: str) -> str:
    """An id in the target API's style (`msg_…`, `toolu_…`, `resp_…`, `fc_…`, `call_…`)."""
    return f"{prefix}{uuid.uuid4().hex}"


def dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


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
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return separator.join(texts)


def usage_counts(usage: Any) -> tuple[int, int, int]:
    """(prompt_tokens, completion_tokens, cached_prompt_tokens) from a chat-completions `usage` object."""
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), int(cached or 0)


async def aclose_source(source: AsyncIterator[Any]) -> None:
    """Close an upstream iterator we stopped reading, so its `finally` (usage settlement, socket) runs now."""
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
