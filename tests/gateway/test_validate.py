"""`gateway.validate`: every shared field of every route family, against a small reference model of the rules."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway import validate
from gateway.errors import InvalidRequestError
from gateway.validate import (
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
    check_chat_request,
    check_completions,
    check_completions_request,
    check_count_tokens_request,
    check_embeddings_request,
    check_messages,
    check_messages_request,
    check_responses,
    check_responses_request,
    require_model,
)

Check = Callable[[dict[str, Any]], None]


# --- the reference model: one predicate per rule, written plainly ------------------------------------------------


def is_int(value: Any) -> bool:
    return type(value) is int


def number_in(low: float, high: float, *, is_low_open: bool = False) -> Callable[[Any], bool]:
    def rule(value: Any) -> bool:
        if type(value) not in (int, float) or not math.isfinite(value):
            return False
        return (value > low if is_low_open else value >= low) and value <= high

    return rule


def int_in(low: int, high: int) -> Callable[[Any], bool]:
    return lambda value: is_int(value) and low <= value <= high


def is_bool(value: Any) -> bool:
    return type(value) is bool


def is_top_k(value: Any) -> bool:
    return is_int(value) and (value in (-1, 0) or 1 <= value <= MAX_TOP_K)


def is_stop_string(value: Any) -> bool:
    return type(value) is str and 1 <= len(value) <= MAX_STOP_CHARS


def is_stop_list(value: Any) -> bool:
    return type(value) is list and len(value) <= MAX_STOP_SEQUENCES and all(is_stop_string(v) for v in value)


def is_stop(value: Any) -> bool:
    return is_stop_string(value) or is_stop_list(value)


def is_token_ids(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) <= MAX_STOP_TOKEN_IDS
        and all(is_int(v) and 0 <= v <= MAX_TOKEN_ID for v in value)
    )


def is_str(value: Any) -> bool:
    return type(value) is str


def is_tools(value: Any) -> bool:
    return type(value) is list and all(type(tool) is dict for tool in value)


def is_openai_tool_choice(value: Any) -> bool:
    return value in ("none", "auto", "required") or (type(value) is dict and type(value.get("type")) is str)


def is_anthropic_tool_choice(value: Any) -> bool:
    return type(value) is dict and value.get("type") in ("auto", "any", "tool", "none")


def is_response_format(value: Any) -> bool:
    return type(value) is dict and value.get("type") in ("text", "json_object", "json_schema")


def top_logprobs_alone(value: Any) -> bool:
    """Without `logprobs: true` beside it, only 0 is accepted."""
    return int_in(0, MAX_TOP_LOGPROBS)(value) and value == 0


def is_metadata(value: Any) -> bool:
    return type(value) is dict and all(item is None or type(item) is str for item in value.values())


def is_single_choice(value: Any) -> bool:
    """`n` on Messages and Responses: 1 passes; another valid `n` is refused as unsupported (see `agrees`)."""
    return value == 1 and is_int(value)


def is_logit_bias(value: Any) -> bool:
    if type(value) is not dict or len(value) > MAX_LOGIT_BIAS_ENTRIES:
        return False
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_TOKEN_ID):
            return False
        if not number_in(-100, 100)(bias):
            return False
    return True


OPENAI = {
    "stream": is_bool,
    "temperature": number_in(0, 2),
    "top_p": number_in(0, 1),
    "presence_penalty": number_in(-2, 2),
    "frequency_penalty": number_in(-2, 2),
    "n": int_in(1, MAX_N),
    "seed": int_in(-(2**63), 2**63 - 1),
    "stop": is_stop,
    "max_tokens": int_in(1, MAX_TOKENS),
    "logit_bias": is_logit_bias,
    "user": is_str,
    "top_k": is_top_k,
    "min_p": number_in(0, 1),
    "repetition_penalty": number_in(0, 10, is_low_open=True),
    "min_tokens": int_in(0, MAX_TOKENS),
    "stop_token_ids": is_token_ids,
}
RULES: dict[str, tuple[Check, dict[str, Callable[[Any], bool]]]] = {
    "chat": (
        check_chat,
        {
            **OPENAI,
            "max_completion_tokens": int_in(1, MAX_TOKENS),
            "logprobs": is_bool,
            "top_logprobs": top_logprobs_alone,
            "tools": is_tools,
            "tool_choice": is_openai_tool_choice,
            "parallel_tool_calls": is_bool,
            "metadata": is_metadata,
            "response_format": is_response_format,
            "stream_options": lambda value: False,  # only with `stream: true` beside it
        },
    ),
    "completions": (
        check_completions,
        {**OPENAI, "logprobs": int_in(0, MAX_COMPLETION_LOGPROBS), "best_of": int_in(1, MAX_N), "echo": is_bool},
    ),
    "messages": (
        check_messages,
        {
            "stream": is_bool,
            "max_tokens": int_in(1, MAX_TOKENS),
            "temperature": number_in(0, 1),
            "top_p": number_in(0, 1),
            "top_k": is_top_k,
            "stop_sequences": is_stop_list,
            "n": is_single_choice,
            "seed": int_in(-(2**63), 2**63 - 1),
            "tools": is_tools,
            "tool_choice": is_anthropic_tool_choice,
            "metadata": is_metadata,
        },
    ),
    "responses": (
        check_responses,
        {
            "stream": is_bool,
            "max_output_tokens": int_in(1, MAX_TOKENS),
            "temperature": number_in(0, 2),
            "top_p": number_in(0, 1),
            "top_k": is_top_k,
            "stop": is_stop,
            "n": is_single_choice,
            "seed": int_in(-(2**63), 2**63 - 1),
            "top_logprobs": int_in(0, MAX_TOP_LOGPROBS),
            "tools": is_tools,
            "tool_choice": is_openai_tool_choice,
            "parallel_tool_calls": is_bool,
            "metadata": is_metadata,
            "user": is_str,
            "safety_identifier": is_str,
        },
    ),
}
CASES = [(family, name) for family, (_, rules) in RULES.items() for name in rules]


def agrees(family: str, name: str, value: Any) -> None:
    """The checker accepts exactly what the reference rule accepts; a rejection names the field (or the item of
    it at fault: `tools[2]`, `metadata.user_id`)."""
    check, rules = RULES[family]
    body = {"model": "m", name: value}
    if value is None or rules[name](value):
        check(body)
        return
    with pytest.raises(InvalidRequestError) as caught:
        check(body)
    is_unsupported = rules[name] is is_single_choice and int_in(1, MAX_N)(value)
    assert caught.value.status_code == 400
    assert caught.value.code == ("unsupported_parameter" if is_unsupported else "invalid_request")
    param = caught.value.param
    assert param is not None and (param == name or param.startswith((f"{name}[", f"{name}.")))
    assert f"`{param}`" in caught.value.message and len(caught.value.message) < 400


# --- values at and around every boundary -------------------------------------------------------------------------

EDGES: list[Any] = [
    None,
    True,
    False,
    -(2**63) - 1,
    -(2**63),
    -101,
    -100,
    -2.5,
    -2,
    -1,
    -0.5,
    0,
    0.0,
    0.5,
    1,
    1.0,
    1.5,
    2,
    2.0000001,
    3,
    4,
    5,
    6,
    10,
    10.5,
    16,
    20,
    21,
    100,
    101,
    127,
    128,
    129,
    MAX_TOP_K,
    MAX_TOP_K + 1,
    MAX_TOKENS,
    MAX_TOKENS + 1,
    2**63 - 1,
    2**63,
    1e20,
    1e30,
    -1e30,
    "",
    "x",
    "1",
    "STOP",
    "x" * MAX_STOP_CHARS,
    "x" * (MAX_STOP_CHARS + 1),
    [],
    [1],
    [""],
    ["a"],
    ["a", "b", "c", "d"],
    ["a", "b", "c", "d", "e"],
    ["a", None],
    [0, 1, 2],
    [-1],
    [MAX_TOKEN_ID + 1],
    list(range(MAX_STOP_TOKEN_IDS)),
    list(range(MAX_STOP_TOKEN_IDS + 1)),
    {},
    "auto",
    "none",
    "required",
    "any",
    {"type": "function", "function": {"name": "f"}},
    {"type": 5},
    {"user_id": "user-1"},
    {"user_id": None},
    {"user_id": 5},
    [{"type": "function"}],
    [{}, 5],
    {"1": 5},
    {"50256": -100},
    {"1": 100.5},
    {"x": 1},
    {"-1": 1},
    {"1": True},
    {"²": 1},
    {str(MAX_TOKEN_ID + 1): 1},
    {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)},
]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_edges_agree_with_the_reference(family: str, name: str) -> None:
    for value in EDGES:
        agrees(family, name, value)


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(
    JSON_SCALARS | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@given(st.sampled_from(CASES), JSON)
def test_any_json_value_agrees_with_the_reference(case: tuple[str, str], value: Any) -> None:
    agrees(*case, value)


@given(st.sampled_from(CASES), st.floats(allow_nan=True, allow_infinity=True))
def test_floats_including_non_finite_agree(case: tuple[str, str], value: float) -> None:
    agrees(*case, value)


# --- the reproducers and the documented limits -------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "body", "param"),
    [
        (check_chat, {"stop": [1]}, "stop"),
        (check_chat, {"seed": 1e20}, "seed"),
        (check_chat, {"top_k": 1e30}, "top_k"),
        (check_chat, {"stop": ["s"] * 10_000}, "stop"),
        (check_chat, {"n": 1000}, "n"),
        (check_chat, {"temperature": "hot"}, "temperature"),
        (check_completions, {"logprobs": 6}, "logprobs"),
        (check_completions, {"best_of": 0}, "best_of"),
        (check_messages, {"stop_sequences": [1]}, "stop_sequences"),
        (check_messages, {"stop_sequences": "END"}, "stop_sequences"),  # a list in Anthropic's API
        (check_messages, {"temperature": 1.5}, "temperature"),  # Anthropic's range is 0..1
        (check_responses, {"max_output_tokens": 0}, "max_output_tokens"),
        (check_responses, {"top_logprobs": 21}, "top_logprobs"),
        (check_chat, {"top_logprobs": 5}, "top_logprobs"),  # OpenAI: needs `logprobs: true`
        (check_chat, {"top_logprobs": 5, "logprobs": False}, "top_logprobs"),
        (check_chat, {"stream_options": {"include_usage": True}}, "stream_options"),  # only when streaming
        (check_chat, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
        (check_chat, {"response_format": "json"}, "response_format"),
        (check_chat, {"response_format": {"type": "yaml"}}, "response_format"),
        (check_messages, {"tool_choice": {"type": "weird"}}, "tool_choice"),
    ],
)
def test_the_reported_bodies_are_rejected(check: Check, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check({"model": "m", **body})
    assert caught.value.param == param


def test_fields_that_need_a_partner_are_accepted_with_it() -> None:
    check_chat({"model": "m", "top_logprobs": 5, "logprobs": True})
    check_chat({"model": "m", "stream_options": {"include_usage": True}, "stream": True})
    check_chat({"model": "m", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})


def test_a_huge_value_is_cut_short_in_the_message() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_chat({"temperature": "x" * 1_000_000})
    assert len(caught.value.message) < 200


@pytest.mark.parametrize(("family", "name"), CASES)
def test_a_deeply_nested_value_is_refused_with_a_short_message(family: str, name: str) -> None:
    deep: Any = "deep"
    for _ in range(5_000):  # deeper than `repr` can go
        deep = [deep]
    agrees(family, name, deep)
    if name in ("metadata", "tools"):
        agrees(family, name, {"a": deep} if name == "metadata" else [{}, deep])


def test_unknown_fields_and_nulls_are_not_looked_at() -> None:
    body = {"model": "m", "temperature": None, "stop": None, "whatever": object(), "n": None}
    check_chat(body)
    check_completions(body)
    check_messages({"model": "m", "thinking": object(), "top_k": None})
    check_responses({"model": "m", "reasoning": object(), "stop_sequences": [1]})  # Messages' name, not Responses'


@pytest.mark.parametrize("check", [check_messages, check_responses])
def test_more_than_one_choice_is_unsupported_where_the_family_answers_once(check: Check) -> None:
    check({"model": "m", "n": 1})
    with pytest.raises(InvalidRequestError) as caught:
        check({"model": "m", "n": 2})
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", "n")


@pytest.mark.parametrize("model", [None, "", "  ", 5, True, [], {}])
def test_model_must_be_a_non_empty_string(model: Any) -> None:
    body = {} if model is None else {"model": model}
    with pytest.raises(InvalidRequestError) as caught:
        require_model(body)
    assert (caught.value.code, caught.value.param) == ("invalid_request", "model")
    assert require_model({"model": "gpt-test"}) == "gpt-test"


# --- each route's whole check: `model` once, then the family's fields, then the shape routing needs ---------------

MESSAGES = [{"role": "user", "content": "Hi"}]
REQUEST_CHECKS: list[tuple[Callable[[dict[str, Any]], str], dict[str, Any], str]] = [
    (check_chat_request, {"messages": MESSAGES}, "messages"),
    (check_completions_request, {"prompt": "Once"}, "prompt"),
    (check_embeddings_request, {"input": "text"}, "input"),
    (check_messages_request, {"messages": MESSAGES}, "messages"),
    (check_count_tokens_request, {"messages": MESSAGES}, "messages"),
    (check_responses_request, {"input": "Hi"}, ""),
]


@pytest.mark.parametrize(("check", "body", "shape_field"), REQUEST_CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_each_request_check_returns_the_model_checking_it_once(
    check: Callable[[dict[str, Any]], str], body: dict[str, Any], shape_field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(validate, "require_model", lambda b: calls.append(b) or b["model"])
    assert check({"model": "gpt-test", **body}) == "gpt-test"
    assert len(calls) == 1


@pytest.mark.parametrize(("check", "body", "shape_field"), REQUEST_CHECKS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_request_check_refuses_the_model_first_then_the_shape(
    check: Callable[[dict[str, Any]], str], body: dict[str, Any], shape_field: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check({**body, shape_field: None})
    assert caught.value.param == "model"
    if shape_field:
        with pytest.raises(InvalidRequestError) as caught:
            check({"model": "m", **body, shape_field: 5})
        assert caught.value.param == shape_field


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"content": "Hi"}, "messages[0].role"),
        ({"role": "robot", "content": "Hi"}, "messages[0].role"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
        ({"role": "assistant", "tool_calls": {}}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {}}]}, "messages[0].tool_calls[0]"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_chat_messages_are_checked_where_routing_and_accounting_read_them(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_chat_request({"model": "m", "messages": [message]})
    assert (caught.value.code, caught.value.param) == ("invalid_request", param)
