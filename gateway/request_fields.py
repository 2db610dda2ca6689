"""Each family's request fields: one validator per concept (a range or a type), and each family's table from its
field names to them.

    check_chat(body)           /v1/chat/completions
    check_completions(body)    /v1/completions (also: at most MAX_N completions, prompts × n)
    check_messages(body)       /v1/messages
    check_responses(body)      /v1/responses

The families name some concepts differently (the output limit is `max_tokens`, `max_completion_tokens` or
`max_output_tokens`; stop strings are `stop` or `stop_sequences`; Anthropic's end user is `metadata.user_id`), so
each family has a table from its field names to the concept validators below: the same bad value is refused by
every family with the same `code`, and `param` names the field as that family's client sent it. Ranges are
OpenAI's (Anthropic's for /v1/messages); the limits are documented in docs/api-limits.md.

Each check looks up only the fields in its table (one dict lookup each; `null` means unset) and looks one level
into a list or object at most (`tools`, `metadata`); it never copies or re-serializes the body, and raises
`InvalidRequestError` (400 `invalid_request`; `unsupported_parameter` for `n` above 1 where the family returns
one answer) on the first wrong type or range. Routes do not call these: `gateway.validate` runs the family's
table as part of its one check per request.
"""

from __future__ import annotations

import math
import reprlib
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
    "count_prompts",
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
_MAX_PARAM_KEY_CHARS = 64  # a `metadata` key longer than this (OpenAI's limit) is not repeated in `param`
_INT64 = (-(2**63), 2**63 - 1)  # `seed`

_Check = Callable[[str, Any], None]


# ---------------------------------------------------------------- each family's field table


def check_chat(body: Mapping[str, Any]) -> None:
    _check(body, _CHAT)
    top_logprobs = body.get("top_logprobs") or 0  # checked above: an integer, when set
    if top_logprobs > 0 and body.get("logprobs") is not True:
        raise InvalidRequestError(
            "`top_logprobs` needs `logprobs: true`.", code="invalid_request", param="top_logprobs"
        )
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequestError(
            "`stream_options` is only allowed with `stream: true`.", code="invalid_request", param="stream_options"
        )


def check_completions(body: Mapping[str, Any]) -> None:
    _check(body, _COMPLETIONS)
    num_prompts = count_prompts(body)
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    if num_prompts * n > MAX_N:
        raise InvalidRequestError(
            f"`prompt` holds {num_prompts} prompts and `n` is {n}: {num_prompts * n} completions in one request; at "
            f"most {MAX_N} (prompts × n). Split the prompts over several requests.",
            code="invalid_request",
            param="prompt",
        )


def count_prompts(body: Mapping[str, Any]) -> int:
    """Prompts in a /v1/completions body: a list of strings or of token-id lists is one per item; a string or a
    list of token ids is one. Each is answered with `n` choices, and each may use `max_tokens`."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


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


_REPR = reprlib.Repr()  # a nested value is shown a few levels deep (`repr` would recurse through all of them)
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 40


def _show(value: Any) -> str:
    """The offending value for the message, cut short: it is caller input of any size and depth."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- validators, one per kind of value


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


def _string(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _invalid(name, "a string", value)


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
    """Anthropic's `stop_sequences`: a list of strings."""
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


def _single_choice(name: str, value: Any) -> None:
    """`n` where the family returns one answer (Messages, Responses): 1, or left out."""
    _N(name, value)
    if value != 1:
        raise InvalidRequestError(
            f"`{name}` must be 1 here: this API returns one answer per request (got {value}).",
            code="unsupported_parameter",
            param=name,
        )


def _tools(name: str, value: Any) -> None:
    """The shape every family shares: a list of objects (each family's translation checks their fields)."""
    if not isinstance(value, list):
        raise _invalid(name, "a list of tool objects", value)
    for index, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise _invalid(f"{name}[{index}]", "a tool object", tool)


_OPENAI_TOOL_CHOICES = ("none", "auto", "required")


def _openai_tool_choice(name: str, value: Any) -> None:
    rule = '"none", "auto", "required" or an object with a string `type`'
    if isinstance(value, str):
        if value not in _OPENAI_TOOL_CHOICES:
            raise _invalid(name, rule, value)
    elif not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _invalid(name, rule, value)


def _anthropic_tool_choice(name: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise _invalid(name, 'an object whose `type` is "auto", "any", "tool" or "none"', value)


def _response_format(name: str, value: Any) -> None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise _invalid(name, 'an object whose `type` is "text", "json_object" or "json_schema"', value)


def _object(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise _invalid(name, "an object", value)


def _metadata(name: str, value: Any) -> None:
    """An object of string values (OpenAI's `metadata`; Anthropic's, whose `user_id` is the end user)."""
    if not isinstance(value, dict):
        raise _invalid(name, "an object of string values", value)
    for key, item in value.items():
        if item is not None and not isinstance(item, str):
            param = f"{name}.{key}" if len(key) <= _MAX_PARAM_KEY_CHARS else name
            raise _invalid(param, "a string", item)


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


# ---------------------------------------------------------------- the concepts, and each family's names for them

_OUTPUT_LIMIT = _integer(1, MAX_TOKENS)  # max_tokens / max_completion_tokens / max_output_tokens
_OPENAI_TEMPERATURE = _number(0, 2)
_ANTHROPIC_TEMPERATURE = _number(0, 1)
_TOP_P = _number(0, 1)
_N = _integer(1, MAX_N)
_SEED = _integer(*_INT64)

_OPENAI_COMMON: dict[str, _Check] = {
    "stream": _boolean,
    "temperature": _OPENAI_TEMPERATURE,
    "top_p": _TOP_P,
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "n": _N,
    "seed": _SEED,
    "stop": _stop,
    "max_tokens": _OUTPUT_LIMIT,
    "logit_bias": _logit_bias,
    "user": _string,
    # vLLM-style extensions the local engine (and vLLM / SGLang upstreams) read:
    "top_k": _top_k,
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, 10, is_low_open=True),
    "min_tokens": _integer(0, MAX_TOKENS),
    "stop_token_ids": _token_ids,
}
_CHAT: dict[str, _Check] = {
    **_OPENAI_COMMON,
    "max_completion_tokens": _OUTPUT_LIMIT,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
    "tools": _tools,
    "tool_choice": _openai_tool_choice,
    "parallel_tool_calls": _boolean,
    "metadata": _metadata,
    "response_format": _response_format,
    "stream_options": _object,
}
_COMPLETIONS: dict[str, _Check] = {
    **_OPENAI_COMMON,
    "logprobs": _integer(0, MAX_COMPLETION_LOGPROBS),
    "best_of": _integer(1, MAX_N),
    "echo": _boolean,
}
# Messages and Responses have no `n` or `seed` (nor Responses `stop`, `top_k`): a client's are checked the same way
# and carried over by the translation to chat completions, except `n`, which may only be 1 (one answer per request).
_MESSAGES: dict[str, _Check] = {
    "stream": _boolean,
    "max_tokens": _OUTPUT_LIMIT,
    "temperature": _ANTHROPIC_TEMPERATURE,
    "top_p": _TOP_P,
    "top_k": _top_k,
    "stop_sequences": _stop_list,
    "n": _single_choice,
    "seed": _SEED,
    "tools": _tools,
    "tool_choice": _anthropic_tool_choice,
    "metadata": _metadata,  # `metadata.user_id`: the end user
}
_RESPONSES: dict[str, _Check] = {
    "stream": _boolean,
    "max_output_tokens": _OUTPUT_LIMIT,
    "temperature": _OPENAI_TEMPERATURE,
    "top_p": _TOP_P,
    "top_k": _top_k,
    "stop": _stop,
    "n": _single_choice,
    "seed": _SEED,
    "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
    "tools": _tools,
    "tool_choice": _openai_tool_choice,
    "parallel_tool_calls": _boolean,
    "metadata": _metadata,
    "user": _string,
    "safety_identifier": _string,
}
