"""Edge validation of the sampling fields that upstreams and the local engine act on, per route family.

    check_chat(body)          /v1/chat/completions
    check_completions(body)   /v1/completions
    check_messages(body)      /v1/messages
    check_responses(body)     /v1/responses

Each looks up only the fields in its table (one dict lookup each; `null` means unset), never walks, copies or
re-serializes the body, and raises `InvalidRequestError` (400 `invalid_request`, `param` = the field) on the
first wrong type or range. Ranges are OpenAI's (Anthropic's for /v1/messages); the limits below are documented
in docs/api-limits.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gateway.errors import InvalidRequestError

__all__ = [
    "MAX_COMPLETION_LOGPROBS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_N",
    "MAX_STOP_CHARS",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "check_chat",
    "check_completions",
    "check_messages",
    "check_responses",
]

MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`; applied to Anthropic's `stop_sequences` too
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_N = 128  # choices per request (`n`; `best_of` on /v1/completions)
MAX_TOKENS = 2**31 - 1  # any max_tokens / max_completion_tokens / max_output_tokens / min_tokens
MAX_TOP_K = 2**20  # above every vocabulary; the engine clamps to its own
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs`, Responses `top_logprobs`
MAX_COMPLETION_LOGPROBS = 5  # legacy /v1/completions `logprobs`
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOKEN_ID = 2**31 - 1
_INT64 = (-(2**63), 2**63 - 1)  # `seed`

_Check = Callable[[str, Any], None]


def check_chat(body: Mapping[str, Any]) -> None:
    _check(body, _CHAT)


def check_completions(body: Mapping[str, Any]) -> None:
    _check(body, _COMPLETIONS)


def check_messages(body: Mapping[str, Any]) -> None:
    _check(body, _MESSAGES)


def check_responses(body: Mapping[str, Any]) -> None:
    _check(body, _RESPONSES)


def _check(body: Mapping[str, Any], table: Mapping[str, _Check]) -> None:
    for name, check in table.items():
        value = body.get(name)
        if value is not None:
            check(name, value)


def _invalid(name: str, rule: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(f"`{name}` must be {rule} (got {_show(value)}).", code="invalid_request", param=name)


def _show(value: Any) -> str:
    """The offending value for the message, cut short: it is caller input of any size."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(low: float, high: float, *, is_low_open: bool = False) -> _Check:
    rule = f"a number above {low:g} and at most {high:g}" if is_low_open else f"a number from {low:g} to {high:g}"

    def check(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _invalid(name, rule, value)
        if not (low < value if is_low_open else low <= value) or value > high:
            raise _invalid(name, rule, value)

    return check


def _integer(low: int, high: int) -> _Check:
    rule = f"an integer from {low} to {high}"

    def check(name: str, value: Any) -> None:
        if not _is_int(value) or not low <= value <= high:
            raise _invalid(name, rule, value)

    return check


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _invalid(name, "true or false", value)


def _top_k(name: str, value: Any) -> None:
    if not _is_int(value) or not (value in (-1, 0) or 1 <= value <= MAX_TOP_K):
        raise _invalid(name, f"an integer: -1 or 0 (off), or 1 to {MAX_TOP_K}", value)


def _stop_string(name: str, value: Any, where: str) -> None:
    rule = f"a non-empty string of at most {MAX_STOP_CHARS} characters"
    if not isinstance(value, str) or not 0 < len(value) <= MAX_STOP_CHARS:
        raise InvalidRequestError(
            f"`{name}`{where} must be {rule} (got {_show(value)}).", code="invalid_request", param=name
        )


def _stop_list(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_STOP_SEQUENCES:
        raise _invalid(name, f"a list of at most {MAX_STOP_SEQUENCES} strings", value)
    for index, item in enumerate(value):
        _stop_string(name, item, f"[{index}]")


def _stop(name: str, value: Any) -> None:
    """OpenAI's `stop`: one string or a list of them."""
    if isinstance(value, str):
        _stop_string(name, value, "")
    elif isinstance(value, list):
        _stop_list(name, value)
    else:
        raise _invalid(name, f"a string or a list of at most {MAX_STOP_SEQUENCES} strings", value)


def _token_ids(name: str, value: Any) -> None:
    rule = f"a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers from 0 to {MAX_TOKEN_ID})"
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise _invalid(name, rule, value)
    for item in value:
        if not _is_int(item) or not 0 <= item <= MAX_TOKEN_ID:
            raise _invalid(name, rule, value)


def _logit_bias(name: str, value: Any) -> None:
    rule = (
        f"an object of at most {MAX_LOGIT_BIAS_ENTRIES} entries mapping token ids (decimal strings) "
        "to numbers from -100 to 100"
    )
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(name, rule, value)
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_TOKEN_ID):
            raise _invalid(name, rule, key)
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise _invalid(name, rule, bias)


_MAX_TOKENS = _integer(1, MAX_TOKENS)
_OPENAI_SAMPLING: dict[str, _Check] = {
    "stream": _boolean,
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "n": _integer(1, MAX_N),
    "seed": _integer(*_INT64),
    "stop": _stop,
    "max_tokens": _MAX_TOKENS,
    "logit_bias": _logit_bias,
    # vLLM-style extensions the local engine (and vLLM / SGLang upstreams) read:
    "top_k": _top_k,
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, 10, is_low_open=True),
    "min_tokens": _integer(0, MAX_TOKENS),
    "stop_token_ids": _token_ids,
}
_CHAT: dict[str, _Check] = {
    **_OPENAI_SAMPLING,
    "max_completion_tokens": _MAX_TOKENS,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
}
_COMPLETIONS: dict[str, _Check] = {
    **_OPENAI_SAMPLING,
    "logprobs": _integer(0, MAX_COMPLETION_LOGPROBS),
    "best_of": _integer(1, MAX_N),
    "echo": _boolean,
}
_MESSAGES: dict[str, _Check] = {
    "stream": _boolean,
    "max_tokens": _MAX_TOKENS,
    "temperature": _number(0, 1),
    "top_p": _number(0, 1),
    "top_k": _top_k,
    "stop_sequences": _stop_list,
}
_RESPONSES: dict[str, _Check] = {
    "stream": _boolean,
    "max_output_tokens": _MAX_TOKENS,
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
}
