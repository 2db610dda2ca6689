"""Validate and repair OpenAI-family responses and stream chunks before they reach the client.

Clients crash with "error reading choices" on bodies that are almost right. We repair what has exactly one
meaning (a missing `index`, a missing `finish_reason`, `content` absent next to `tool_calls`, a missing
`role`) and reject the rest with 502 `upstream_malformed_response`, saying what was wrong.

`name_model` makes an answer of any family name the public id of the model that served it (a fallback's own, an
alias's id), as OpenAI names the model that served; the upstream's own name goes in `UPSTREAM_MODEL_HEADER`.
"""

from __future__ import annotations

from typing import Any

import orjson

from backends.base import Endpoint, Json
from gateway.errors import upstream_malformed

__all__ = ["UPSTREAM_MODEL_HEADER", "name_model", "normalize_chunk", "normalize_response", "upstream_model_header"]

UPSTREAM_MODEL_HEADER = "x-unigate-upstream-model"
_MAX_HEADER_MODEL_CHARS = 256


def normalize_response(endpoint: Endpoint, body: Any) -> Json:
    """Check a non-streaming response of `endpoint`; returns it (repaired in place) or raises."""
    if not isinstance(body, dict):
        raise upstream_malformed(f"the body is a JSON {type(body).__name__}, not an object")
    if endpoint == "embeddings":
        _check_embeddings(body)
    elif endpoint in ("chat/completions", "completions"):
        choices = _choices(body, allow_empty=False)
        is_chat = endpoint == "chat/completions"
        for position, choice in enumerate(choices):
            _check_choice(choice, position, is_chat=is_chat, is_chunk=False)
    return body


def normalize_chunk(endpoint: Endpoint, chunk: Any) -> Json:
    """Check one streamed chunk; an empty `choices` list is valid (the final usage chunk)."""
    if not isinstance(chunk, dict):
        raise upstream_malformed(f"a stream chunk is a JSON {type(chunk).__name__}, not an object")
    if endpoint in ("chat/completions", "completions"):
        choices = _choices(chunk, allow_empty=True)
        is_chat = endpoint == "chat/completions"
        for position, choice in enumerate(choices):
            _check_choice(choice, position, is_chat=is_chat, is_chunk=True)
    return chunk


def name_model(data: Json, model_id: str) -> Any:
    """Put `model_id` where an answer or stream event names its model: the top-level `model` (chat, completions,
    embeddings, Messages and Responses answers, chat chunks), a Messages stream's `message_start` message, or a
    Responses stream event's `response`. Returns the name that was there (None when it named none)."""
    holder: Any = data
    if "model" not in data:
        holder = data.get("message") if data.get("type") == "message_start" else data.get("response")
        if not isinstance(holder, dict) or "model" not in holder:
            return None
    upstream = holder["model"]
    holder["model"] = model_id
    return upstream


def upstream_model_header(name: Any) -> str | None:
    """The upstream's own model name as a header value: a short printable ASCII string, else None (not sent)."""
    if isinstance(name, str) and 0 < len(name) <= _MAX_HEADER_MODEL_CHARS and name.isascii() and name.isprintable():
        return name
    return None


def _choices(body: Json, *, allow_empty: bool) -> list[Any]:
    if "choices" not in body:
        raise upstream_malformed("it has no `choices` field")
    choices = body["choices"]
    if not isinstance(choices, list):
        raise upstream_malformed(f"`choices` is a {type(choices).__name__}, not a list")
    if not choices and not allow_empty:
        raise upstream_malformed("`choices` is empty")
    return choices


def _check_choice(choice: Any, position: int, *, is_chat: bool, is_chunk: bool) -> None:
    where = f"choices[{position}]"
    if not isinstance(choice, dict):
        raise upstream_malformed(f"`{where}` is a {type(choice).__name__}, not an object")
    if "index" not in choice:
        choice["index"] = position
    elif not isinstance(choice["index"], int):
        raise upstream_malformed(f"`{where}.index` is not an integer")
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise upstream_malformed(f"`{where}.finish_reason` is not a string")
    if is_chat:
        field = "delta" if is_chunk else "message"
        if field not in choice:
            if is_chunk and finish_reason is not None:
                choice["delta"] = {}  # a closing chunk that only carries finish_reason
                return
            raise upstream_malformed(f"`{where}` has no `{field}`")
        _check_message(choice[field], f"{where}.{field}", is_chunk=is_chunk)
        if not is_chunk and "finish_reason" not in choice:
            choice["finish_reason"] = "tool_calls" if choice[field].get("tool_calls") else "stop"
    else:
        text = choice.get("text")
        if not isinstance(text, str):
            kind = "missing" if text is None else f"a {type(text).__name__}"
            raise upstream_malformed(f"`{where}.text` is {kind}, not a string")
        if not is_chunk and "finish_reason" not in choice:
            choice["finish_reason"] = "stop"


def _check_message(message: Any, where: str, *, is_chunk: bool) -> None:
    if not isinstance(message, dict):
        raise upstream_malformed(f"`{where}` is a {type(message).__name__}, not an object")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise upstream_malformed(f"`{where}.tool_calls` is a {type(tool_calls).__name__}, not a list")
    for position, call in enumerate(tool_calls or ()):
        _check_tool_call(call, f"{where}.tool_calls[{position}]", is_chunk=is_chunk)
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise upstream_malformed(f"`{where}.content` is a {type(content).__name__}, not a string")
    if is_chunk:
        return
    if "role" not in message:
        message["role"] = "assistant"
    if "content" not in message:
        if tool_calls or message.get("refusal") is not None:
            message["content"] = None
        else:
            raise upstream_malformed(f"`{where}` has neither `content` nor `tool_calls`")


def _check_tool_call(call: Any, where: str, *, is_chunk: bool) -> None:
    """A tool call's fields have the types every client (and our translators) read; a chunk's carry only what
    changed, so only those present are checked. Arguments sent as an object are repaired to its JSON text."""
    if not isinstance(call, dict):
        raise upstream_malformed(f"`{where}` is a {type(call).__name__}, not an object")
    for name, kind in (("id", str), ("type", str), ("index", int)):
        if call.get(name) is not None and (not isinstance(call[name], kind) or isinstance(call[name], bool)):
            raise upstream_malformed(f"`{where}.{name}` is a {type(call[name]).__name__}, not a {kind.__name__}")
    function = call.get("function")
    if function is None and is_chunk:
        return
    if not isinstance(function, dict):
        raise upstream_malformed(f"`{where}.function` is {'missing' if function is None else 'not an object'}")
    if isinstance(function.get("arguments"), dict):
        function["arguments"] = orjson.dumps(function["arguments"]).decode()
    for name in ("name", "arguments"):
        if function.get(name) is not None and not isinstance(function[name], str):
            raise upstream_malformed(f"`{where}.function.{name}` is a {type(function[name]).__name__}, not a string")


def _check_embeddings(body: Json) -> None:
    data = body.get("data")
    if not isinstance(data, list):
        kind = "missing" if data is None else f"a {type(data).__name__}"
        raise upstream_malformed(f"`data` is {kind}, not a list of embeddings")
    for position, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("embedding"), (list, str)):
            raise upstream_malformed(f"`data[{position}].embedding` is missing or not a list")
        if "index" not in item:
            item["index"] = position
