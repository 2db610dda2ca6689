"""Edge validation of request bodies: each route's one check, run once per request.

    model = check_chat_request(body)           /v1/chat/completions: `model`, the shared fields, `messages`
    model = check_completions_request(body)    /v1/completions: `model`, the shared fields, `prompt`
    model = check_embeddings_request(body)     /v1/embeddings: `model`, `input`
    model = check_messages_request(body)       /v1/messages: `model`, the shared fields, `messages`
    model = check_count_tokens_request(body)   /v1/messages/count_tokens: `model`, `messages`
    model = check_responses_request(body)      /v1/responses: `model`, the shared fields

Each runs `require_model` (once per request), then that family's field table (the sampling, output-limit, stop and
tool fields every family shares, one validator per concept: `gateway.request_fields`, whose names are re-exported
here), then the shape of what the request is about: chat messages and their tool calls, or a `prompt` / `input`.
A wrong value raises `InvalidRequestError` (400 `invalid_request`) naming the field in `param`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.request_fields import (
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    check_chat,
    check_completions,
    check_messages,
    check_responses,
    count_prompts,
)

__all__ = [
    "MAX_COMPLETION_LOGPROBS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_MODEL_CHARS",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "check_chat",
    "check_chat_request",
    "check_completions",
    "check_completions_request",
    "check_count_tokens_request",
    "check_embeddings_request",
    "check_messages",
    "check_messages_request",
    "check_responses",
    "check_responses_request",
    "count_prompts",
    "require_model",
]

MAX_MODEL_CHARS = 256  # model ids are short; a wildcard route forwards any name, and usage is kept per name


def require_model(body: Mapping[str, Any]) -> str:
    """`model`, which every family requires: a non-empty string of at most `MAX_MODEL_CHARS` characters."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        what = "missing" if model is None else "not a non-empty string"
        raise InvalidRequestError(
            f"`model` is {what}. Set it to a model ID from GET /v1/models.", code="invalid_request", param="model"
        )
    if len(model) > MAX_MODEL_CHARS:
        raise InvalidRequestError(
            f"`model` is {len(model)} characters long; model IDs have at most {MAX_MODEL_CHARS}. Set it to a model "
            "ID from GET /v1/models.",
            code="invalid_request",
            param="model",
        )
    return model


# ---------------------------------------------------------------- each route's request, checked once


def check_chat_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    check_chat(body)
    _check_chat_messages(body)
    return model


def check_completions_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    check_completions(body)
    _require_input(body, "prompt", '"Once upon a time"')
    return model


def check_embeddings_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    _require_input(body, "input", '"text to embed"')
    return model


def check_messages_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    check_messages(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            '`messages` must be a non-empty list like [{"role": "user", "content": "Hi"}].', param="messages"
        )
    return model


def check_count_tokens_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    if not isinstance(body.get("messages"), list):
        raise InvalidRequestError("`messages` must be a list of {role, content} objects.", param="messages")
    return model


def check_responses_request(body: Mapping[str, Any]) -> str:
    model = require_model(body)
    check_responses(body)
    return model


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_request", param=param)


def _check_chat_messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else "not a non-empty list"
        raise _refuse(f'`messages` is {what}. Send a list like [{{"role": "user", "content": "Hi"}}].', "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _refuse(f"`messages[{index}]` must be an object with a string `role`.", f"messages[{index}].role")
        if message["role"] not in _ROLES:
            roles = ", ".join(f"'{role}'" for role in _ROLES)
            raise _refuse(f"`messages[{index}].role` must be one of {roles}.", f"messages[{index}].role")
        _check_tool_calls(message.get("tool_calls"), f"messages[{index}].tool_calls")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            param = f"messages[{index}].content"
            raise _refuse(f"`{param}` must be a string or a list of content part objects.", param)
        for position, part in enumerate(content):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                param = f"messages[{index}].content[{position}].text"
                raise _refuse(f"`{param}` must be a string.", param)


def _check_tool_calls(tool_calls: Any, param: str) -> None:
    """An assistant message's `tool_calls`: objects whose `function` has a string `name` and `arguments`."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise _refuse(f"`{param}` must be a list of tool call objects.", param)
    for position, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _refuse(
                f"`{param}[{position}]` must be an object with a `function` holding a string `name`.",
                f"{param}[{position}]",
            )
        if not isinstance(function.get("arguments", ""), str):
            where = f"{param}[{position}].function.arguments"
            raise _refuse(f"`{where}` must be a string (the arguments' JSON text).", where)


def _require_input(body: Mapping[str, Any], name: str, example: str) -> None:
    """`prompt` / `input`: a string or a non-empty list (its items are the estimate's and the backend's business)."""
    value = body.get(name)
    if not (isinstance(value, str) or (isinstance(value, list) and value)):
        what = "missing" if value is None else "not a string or a non-empty list"
        raise _refuse(f'`{name}` is {what}. Send e.g. "{name}": {example}.', name)
