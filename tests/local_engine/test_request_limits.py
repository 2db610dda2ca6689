"""The request-field limits the engine enforces itself (pure Python): every bad type or range is an
`InvalidParamError` naming the request's field, before anything reaches the engine thread."""

from __future__ import annotations

from typing import Any

import pytest

from local_engine.errors import InvalidParamError
from local_engine.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SEED,
    MAX_STOP_SEQUENCE_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MIN_SEED,
    SamplingParams,
    from_openai,
    sampling_defaults,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # the values that stopped the engine for every tenant (issue 25, item 1)
        ({"stop": [1]}, "stop"),
        ({"seed": 1e20}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"seed": MIN_SEED - 1}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": "5"}, "top_k"),
        # types and ranges of the rest
        ({"stop": ["a"] * (MAX_STOP_SEQUENCES + 1)}, "stop"),
        ({"stop": ["x" * (MAX_STOP_SEQUENCE_CHARS + 1)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": {"a": 1}}, "stop"),
        ({"n": 0}, "n"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "1"}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_chat_fields_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        from_openai({"messages": MESSAGES, **fields}, is_chat=True)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working
    assert len(str(info.value)) < 300  # never echoes a big value back


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"max_tokens": 0}, "max_tokens")],
)
def test_bad_completion_fields_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        from_openai({"prompt": "hi", **fields}, is_chat=False)
    assert info.value.param == param


def test_good_fields_are_read_as_typed_values() -> None:
    params = from_openai(
        {
            "n": 2.0,  # an integral JSON number is an integer
            "seed": MAX_SEED,
            "top_k": 10**12,  # above any vocabulary: no top-k filtering
            "stop": "END",
            "logprobs": True,
            "top_logprobs": 3,
            "max_completion_tokens": 7,
            "max_tokens": 99,  # max_completion_tokens wins, as in OpenAI's API
            "logit_bias": {"5": -100, "3": 2},
            "temperature": 0,
        },
        is_chat=True,
    )
    assert (params.n, params.seed, params.top_k, params.stop) == (2, MAX_SEED, 10**12, ("END",))
    assert (params.logprobs, params.max_tokens, params.logit_bias) == (3, 7, ((3, 2.0), (5, -100.0)))
    assert params.is_greedy and isinstance(params.temperature, float)
    assert from_openai({"prompt": "hi"}, is_chat=False).max_tokens == 16  # the legacy endpoint's default
    assert from_openai({"prompt": "hi", "max_tokens": None}, is_chat=False).max_tokens == 16  # null = not set
    assert from_openai({"seed": MIN_SEED}, is_chat=True).seed == MIN_SEED


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": (1,)},
        {"seed": 2**64},
        {"top_k": 1.5},
        {"stop": ["a"]},  # a list, not a tuple
        {"stop_token_ids": (True,)},
        {"ignore_eos": 1},
        {"logit_bias": ((1, float("nan")),)},
    ],
)
def test_sampling_params_built_directly_are_checked_too(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**fields)
    assert info.value.param in fields


def test_sampling_defaults_fill_only_the_fields_a_request_leaves_out() -> None:
    defaults = sampling_defaults({"temperature": 0.2, "top_p": 0.9, "top_k": 20.0, "repetition_penalty": 1.05})
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    left_out = from_openai({"messages": []}, is_chat=True, defaults=defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.2, 0.9, 20, 1.05)
    assert left_out.min_p == 0.0  # not in the defaults: OpenAI's
    own = from_openai({"temperature": 1, "top_p": None, "top_k": 0}, is_chat=False, defaults=defaults)
    assert (own.temperature, own.top_p, own.top_k) == (1.0, 0.9, 0)  # null is "left out", as in OpenAI's API
    assert from_openai({}, is_chat=True).temperature == 1.0


@pytest.mark.parametrize(
    ("values", "param"),
    [
        ({"seed": 1}, "seed"),
        ({"max_tokens": 64}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "0.2"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_sampling_defaults_are_checked_like_the_fields(values: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamError) as info:
        sampling_defaults(values)
    assert info.value.param == param
