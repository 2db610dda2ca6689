"""Token estimates from request and answer bodies: what admission reserves before the upstream says, and what is
charged when an upstream reports no usage. Characters / 4, images at a fixed cost; bounded walks (depth and
parts), so no body can exhaust the stack or hold the event loop for long."""

from __future__ import annotations

from typing import Any

import orjson

from backends.base import Endpoint, Json
from backends.wire import has_usage_count

__all__ = ["CHARS_PER_TOKEN", "answer_chars", "estimate_prompt_tokens", "has_counts"]

CHARS_PER_TOKEN = 4
_IMAGE_CHARS = 765 * CHARS_PER_TOKEN  # a typical image's prompt cost, so base64 bytes are not counted as text


def estimate_prompt_tokens(endpoint: Endpoint, body: Json) -> int:
    """A cheap upper-ish estimate (characters / 4) used to reserve tokens before the real count is known.

    Any body shape is safe here (fields of the wrong type count as nothing) and the work is bounded: see
    `_content_chars`."""
    if endpoint in ("chat/completions", "messages", "messages/count_tokens"):
        messages = body.get("messages")
        num_chars = sum(_content_chars(m.get("content")) for m in _as_list(messages) if isinstance(m, dict))
        num_chars += _content_chars(body.get("system"))
    elif endpoint == "responses":
        num_chars = _content_chars(body.get("input")) + _content_chars(body.get("instructions"))
    else:
        num_chars = _content_chars(body.get("prompt") if endpoint == "completions" else body.get("input"))
    return num_chars // CHARS_PER_TOKEN + 1


_MAX_ESTIMATE_DEPTH = 32  # list nesting the estimate walks into; deeper content counts as nothing
_MAX_ESTIMATE_PARTS = 1_000_000  # parts the estimate looks at in one content; the rest count a token each


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _content_chars(content: Any) -> int:
    """Characters in a content: a string, or a list of strings, token ids (a token each), text-bearing parts
    (`text` or `content`), images / audio (a fixed cost) and such lists, nested.

    Iterative (an explicit stack, at most `_MAX_ESTIMATE_DEPTH` deep) and looking at no more than
    `_MAX_ESTIMATE_PARTS` parts, so no body can exhaust the stack or hold the event loop for long."""
    if isinstance(content, str):
        return len(content)
    total = 0
    num_parts = 0
    stack: list[tuple[list[Any], int]] = [(content, 1)] if isinstance(content, list) else []
    while stack:
        parts, depth = stack.pop()
        budget = _MAX_ESTIMATE_PARTS - num_parts
        if len(parts) > budget:
            total += (len(parts) - max(budget, 0)) * CHARS_PER_TOKEN
            parts = parts[: max(budget, 0)]
        num_parts += len(parts)
        for part in parts:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, int):
                total += CHARS_PER_TOKEN  # a token id
            elif isinstance(part, list):
                if depth < _MAX_ESTIMATE_DEPTH:
                    stack.append((part, depth + 1))
            elif isinstance(part, dict):
                kind = part.get("type")
                if isinstance(kind, str) and ("image" in kind or "audio" in kind):
                    total += _IMAGE_CHARS
                    continue
                inner = part.get("text") or part.get("content")
                if isinstance(inner, str):
                    total += len(inner)
                elif isinstance(inner, list) and depth < _MAX_ESTIMATE_DEPTH:
                    stack.append((inner, depth + 1))
    return total


_COUNT_FIELDS = ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")
_ANSWER_FIELDS = frozenset(
    {"choices", "message", "content", "text", "refusal", "thinking", "tool_calls", "function", "arguments", "output"}
)


def has_counts(usage: Json | None) -> bool:
    """Whether a usage object reports prompt or completion tokens as numbers (in any family's names)."""
    return usage is not None and has_usage_count(usage, _COUNT_FIELDS)


def answer_chars(data: Json) -> int:
    """Characters of generated text and tool arguments in a non-streaming answer of any family (chat/completions
    `choices`, Anthropic `content`, Responses `output`), for charging one that reported no usage."""
    total = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            for name, inner in value.items():
                if name == "input" and value.get("type") == "tool_use":  # Anthropic tool arguments, as JSON
                    total += len(orjson.dumps(inner)) if depth < _MAX_ESTIMATE_DEPTH else 0
                elif name in _ANSWER_FIELDS and depth < _MAX_ESTIMATE_DEPTH:
                    stack.append((inner, depth + 1))
        elif isinstance(value, list) and depth < _MAX_ESTIMATE_DEPTH:
            stack.extend((inner, depth + 1) for inner in value[:_MAX_ESTIMATE_PARTS])
    return total
