"""Token estimates from request and answer bodies: what admission reserves before the upstream says, and what is
charged when an upstream reports no usage. Bounded walks (depth and parts), so no body can exhaust the stack or hold
the event loop for long.

- `estimate_prompt_tokens`: characters / 4, images at a fixed cost. Cheap and usually high on English, but ~10x
  low on CJK: the TPM reservation keeps it (a rate limit may be approximate; the settle trues it up).
- `prompt_token_bound`: never below the real count for any byte-level BPE (every token covers at least one byte of
  text): the UTF-8 bytes of the text, the JSON of `tools` / `functions`, and `MESSAGE_OVERHEAD` template tokens per
  message (role markers, separators) plus one conversation's worth. Budgets reserve it, and a stream cut before
  its usage chunk is charged it. Images and audio count a fixed 765 tokens each (not a bound: a provider's image
  pricing is its own)."""

from __future__ import annotations

from typing import Any

import orjson

from backends.base import Endpoint, Json
from backends.wire import has_usage_count

__all__ = [
    "CHARS_PER_TOKEN",
    "MESSAGE_OVERHEAD",
    "answer_chars",
    "estimate_prompt_tokens",
    "has_counts",
    "prompt_token_bound",
]

CHARS_PER_TOKEN = 4
_IMAGE_TOKENS = 765  # a typical image's prompt cost, so base64 bytes are not counted as text


# Chat-template tokens per message that are not bytes of its text (role markers, separators: 3-7 in the common
# templates), and once more for the conversation's own start and the assistant's turn.
MESSAGE_OVERHEAD = 8


def estimate_prompt_tokens(endpoint: Endpoint, body: Json) -> int:
    """A cheap upper-ish estimate (characters / 4) used to reserve tokens before the real count is known.

    Any body shape is safe here (fields of the wrong type count as nothing) and the work is bounded: see
    `_content_chars`."""
    return _prompt_size(endpoint, body, per_token=CHARS_PER_TOKEN) // CHARS_PER_TOKEN + 1


def prompt_token_bound(endpoint: Endpoint, body: Json) -> int:
    """An upper bound of the prompt's tokens under any byte-level BPE (see the module docstring)."""
    size = _prompt_size(endpoint, body, per_token=1)
    num_messages = 1
    for name in ("messages", "input"):
        messages = body.get(name)
        if isinstance(messages, list):
            num_messages += sum(1 for m in messages if isinstance(m, dict))
            size += sum(_utf8(m.get("role")) + _utf8(m.get("name")) for m in messages if isinstance(m, dict))
    for name in ("tools", "functions", "tool_choice", "response_format", "text"):
        value = body.get(name)
        if isinstance(value, dict | list):
            try:
                size += len(orjson.dumps(value))
            except orjson.JSONEncodeError:  # nested deeper than 255: refused with 400 before any upstream sees it
                pass
    return size + MESSAGE_OVERHEAD * num_messages


def _utf8(value: Any) -> int:
    return len(value.encode()) if isinstance(value, str) else 0


def _prompt_size(endpoint: Endpoint, body: Json, *, per_token: int) -> int:
    """Characters (`per_token` 4) or UTF-8 bytes (`per_token` 1) of the prompt's text."""
    if endpoint in ("chat/completions", "messages", "messages/count_tokens"):
        messages = body.get("messages")
        size = sum(_content_chars(m.get("content"), per_token) for m in _as_list(messages) if isinstance(m, dict))
        return size + _content_chars(body.get("system"), per_token)
    if endpoint == "responses":
        return _content_chars(body.get("input"), per_token) + _content_chars(body.get("instructions"), per_token)
    return _content_chars(body.get("prompt") if endpoint == "completions" else body.get("input"), per_token)


_MAX_ESTIMATE_DEPTH = 32  # list nesting the estimate walks into; deeper content counts as nothing
_MAX_ESTIMATE_PARTS = 1_000_000  # parts the estimate looks at in one content; the rest count a token each


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _content_chars(content: Any, per_token: int = CHARS_PER_TOKEN) -> int:
    """Characters in a content: a string, or a list of strings, token ids (a token each), text-bearing parts
    (`text` or `content`), images / audio (a fixed cost) and such lists, nested.

    Iterative (an explicit stack, at most `_MAX_ESTIMATE_DEPTH` deep) and looking at no more than
    `_MAX_ESTIMATE_PARTS` parts, so no body can exhaust the stack or hold the event loop for long. With `per_token`
    1 it counts UTF-8 bytes (a token id or a part past the limit: one each)."""
    measure = len if per_token == CHARS_PER_TOKEN else _utf8
    if isinstance(content, str):
        return measure(content)
    total = 0
    num_parts = 0
    stack: list[tuple[list[Any], int]] = [(content, 1)] if isinstance(content, list) else []
    while stack:
        parts, depth = stack.pop()
        budget = _MAX_ESTIMATE_PARTS - num_parts
        if len(parts) > budget:
            total += (len(parts) - max(budget, 0)) * per_token
            parts = parts[: max(budget, 0)]
        num_parts += len(parts)
        for part in parts:
            if isinstance(part, str):
                total += measure(part)
            elif isinstance(part, int):
                total += per_token  # a token id
            elif isinstance(part, list):
                if depth < _MAX_ESTIMATE_DEPTH:
                    stack.append((part, depth + 1))
            elif isinstance(part, dict):
                kind = part.get("type")
                if isinstance(kind, str) and ("image" in kind or "audio" in kind):
                    total += _IMAGE_TOKENS * per_token
                    continue
                inner = part.get("text") or part.get("content")
                if isinstance(inner, str):
                    total += measure(inner)
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
