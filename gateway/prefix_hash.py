"""A request's affinity key: the same conversation gives the same key on every turn and on every gateway instance.

    key = affinity_key(body, session_id, block_chars=256, max_blocks=64, session_keys=True)

With `session_keys`, a session the client names is the key: the `x-session-id` header (`session_id`), then the
body's OpenAI `prompt_cache_key` or `user`, or Anthropic's `metadata.user_id`. Otherwise the key is a hash of the
request's leading text as the engine will see it, cut into fixed-size character blocks: the system prompt (OpenAI
system/developer messages, Anthropic `system`, Responses `instructions`) and the first message after it. Every turn
of an agent resends the whole conversation, so that text is the same on each turn; two conversations that share a
system prompt but start differently get different keys, so they spread over replicas, each of which soon holds
every system prompt. Of each of the two parts only the first `max_blocks` blocks count: a long system prompt does not
hide the first message (its sessions would all share one key), and hashing costs at most `2 × block_chars ×
max_blocks` characters however long the conversation.

Pure functions over the JSON body: no I/O, no state (gateway instances agree because they compute the same key).
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["affinity_key", "block_hashes", "leading_text", "session_key"]

_SYSTEM_ROLES = frozenset({"system", "developer"})


def affinity_key(
    body: dict[str, Any], session_id: str | None, *, block_chars: int, max_blocks: int, session_keys: bool = True
) -> bytes:
    """The request's key (see the module docstring): 16 bytes."""
    if session_keys:
        session = session_key(body, session_id)
        if session is not None:
            return hashlib.blake2b(b"s\0" + session.encode(), digest_size=16).digest()
    limit = block_chars * max_blocks
    system, first = _leading_parts(body)
    text = system[:limit] + first[:limit]
    hashes = block_hashes(text, block_chars=block_chars, max_blocks=2 * max_blocks)
    return hashes[-1] if hashes else b"\0" * 16


def session_key(body: dict[str, Any], session_id: str | None) -> str | None:
    """The session the client named, if any (header first, then the body's fields)."""
    if session_id:
        return session_id
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return value
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and user_id:
            return user_id
    return None


def block_hashes(text: str, *, block_chars: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of `text`'s leading blocks: each covers its block and every block before it (as an engine's
    prefix cache keys its KV blocks). The last, partial block counts only when there are fewer than `max_blocks`."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(len(text), block_chars * max_blocks), block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def leading_text(body: dict[str, Any]) -> str:
    """The system prompt and the first message after it, rendered as `role\ntext\n` parts."""
    system, first = _leading_parts(body)
    return system + first


def _leading_parts(body: dict[str, Any]) -> tuple[str, str]:
    """`(the system prompt, the first message after it)`, rendered."""
    system = "".join(f"system\n{_text(body[name])}\n" for name in ("system", "instructions") if name in body)
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")  # Responses: a string or a list of items
    if isinstance(messages, str):
        return system, f"user\n{messages}\n"
    if not isinstance(messages, list):
        prompt = body.get("prompt")  # legacy completions
        return system, "" if prompt is None else f"user\n{_text(prompt)}\n"
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = str(message.get("role", "user"))
        text = f"{role}\n{_text(message.get('content'))}\n"
        if role not in _SYSTEM_ROLES:
            return system, text
        system += text
    return system, ""


def _text(content: object) -> str:
    """A message's text: a string, or its parts' `text` fields in order (images and the like add nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    if isinstance(content, dict):
        text = content.get("text")
        if isinstance(text, str):
            return text
        return _text(content.get("content"))
    return ""
