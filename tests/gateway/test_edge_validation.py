"""At the edge, in this order: the key (401 before any work on the body), then the body's sampling fields and shapes
(400 naming the field, never 500), and only then translation, estimation and the upstream."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest
from fakes.app import AUTH, CHAT, asgi_client, build_app, single_model
from fakes.upstream import FakeUpstream

from gateway.estimates import estimate_prompt_tokens
from gateway.translate.anthropic import messages_to_chat

DEEP = 990  # under orjson's 1024-level parse limit, over its 254-level write limit and Python's recursion limit
BOGUS = {"authorization": "Bearer sk-ug-not-a-key"}
MESSAGES = {"model": "gpt-test", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES = {"model": "gpt-test", "input": "Hi"}
COMPLETIONS = {"model": "gpt-test", "prompt": "Once"}
PATHS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/messages": MESSAGES,
    "/v1/responses": RESPONSES,
}


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


DEEP_MARK = "<deep>"


def encode(body: Any) -> bytes:
    """The body as JSON; `DEEP_MARK` strings become `DEEP` nested arrays (deeper than json/orjson will write)."""
    deep = b"[" * DEEP + b'"deep"' + b"]" * DEEP
    return orjson.dumps(body).replace(orjson.dumps(DEEP_MARK), deep)


async def post_all(upstream: FakeUpstream, requests: list[tuple[str, Any, dict[str, str]]]) -> list[httpx.Response]:
    async with asgi_client(build_app(single_model(upstream))) as client:
        return [
            await client.post(path, content=encode(body), headers={**headers, "content-type": "application/json"})
            for path, body, headers in requests
        ]


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    if body.get("type") == "error":  # Anthropic's envelope: no `param`, the message names the field
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_request"
        assert param.split("[")[0].split(".")[0] in body["error"]["message"]
    else:
        assert body["error"]["code"] == "invalid_request" and body["error"]["param"] == param


# --- item 1: sampling fields -------------------------------------------------------------------------------------

BAD_SAMPLING = [
    ("/v1/chat/completions", {"stop": [1]}, "stop"),
    ("/v1/chat/completions", {"seed": 1e20}, "seed"),
    ("/v1/chat/completions", {"top_k": 1e30}, "top_k"),
    ("/v1/chat/completions", {"stop": ["x"] * 10_000}, "stop"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/chat/completions", {"temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/completions", {"stop": "x" * 5000}, "stop"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"presence_penalty": "high"}, "presence_penalty"),
    ("/v1/messages", {"stop_sequences": [1]}, "stop_sequences"),
    ("/v1/messages", {"top_k": -5}, "top_k"),
    ("/v1/messages", {"max_tokens": 2**40}, "max_tokens"),
    ("/v1/responses", {"temperature": -1}, "temperature"),
    ("/v1/responses", {"max_output_tokens": "many"}, "max_output_tokens"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD_SAMPLING)
async def test_bad_sampling_fields_are_400_naming_the_field(
    fake_upstream: FakeUpstream, path: str, fields: dict[str, Any], param: str
) -> None:
    [response] = await post_all(fake_upstream, [(path, {**PATHS[path], **fields}, AUTH)])
    assert_400(response, param)
    assert fake_upstream.requests == []


async def test_good_sampling_fields_reach_the_upstream_untouched(fake_upstream: FakeUpstream) -> None:
    fields = {"stop": ["a", "b", "c", "d"], "seed": -(2**63), "top_k": -1, "n": 2, "temperature": 0, "top_p": 1}
    [response] = await post_all(fake_upstream, [("/v1/chat/completions", {**CHAT, **fields}, AUTH)])
    assert response.status_code == 200, response.text
    assert {k: fake_upstream.requests[0].body[k] for k in fields} == fields


# --- item 4: the key first ------------------------------------------------------------------------------------------

UNKNOWN_BLOCKS = 30_000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "x"}] * UNKNOWN_BLOCKS}]}),
        ("/v1/responses", {**RESPONSES, "input": [{"type": "x"}] * UNKNOWN_BLOCKS}),
    ],
)
async def test_a_bogus_key_costs_no_translation_and_a_good_one_one_log_line(
    fake_upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    if path == "/v1/responses":
        body = {**body, "input": [*body["input"], {"role": "user", "content": "Hi"}]}
    with caplog.at_level(logging.WARNING, logger="unigate.translate"):
        bogus, good = await post_all(fake_upstream, [(path, body, BOGUS), (path, body, AUTH)])
    assert bogus.status_code == 401 and good.status_code == 200, good.text
    [line] = [r for r in caplog.records if r.name == "unigate.translate"]  # for the good key; none for the bogus
    assert f"{UNKNOWN_BLOCKS} x" in line.getMessage()
    assert len(fake_upstream.requests) == 1


WRONG_TYPES = [
    ("/v1/messages", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]}, "source"),
    ("/v1/messages", {"messages": [{"role": "assistant", "content": {"type": "text"}}]}, "messages[0].content"),
    ("/v1/messages", {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": 5}]}]}, "name"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 5}]}]}, "content"),
    ("/v1/messages", {"messages": [{"role": "system", "content": 7}]}, "messages[0].content"),
    ("/v1/messages", {"system": [1, 2]}, "system[0]"),
    ("/v1/messages", {"tools": "all"}, "tools"),
    ("/v1/messages", {"tools": [5]}, "tools[0]"),
    ("/v1/messages", {"tools": [{"name": 1, "input_schema": {}}]}, "tools[0].name"),
    ("/v1/messages", {"tools": [{"name": "f", "input_schema": "x"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"messages": [{"role": 5, "content": "x"}]}, "messages[0].role"),
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": nested(5)}]}]}, "text"),
    ("/v1/responses", {"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ("/v1/responses", {"input": [{"role": "user", "content": [7]}]}, "input[0].content[0]"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": []}]}]}, "text"),
    ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": {"a": 1}}]}, "arguments"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "output": 3}]}, "input[0].output"),
    ("/v1/responses", {"instructions": ["be nice"]}, "instructions"),
    ("/v1/responses", {"tools": {"type": "function"}}, "tools"),
    ("/v1/responses", {"tools": ["f"]}, "tools[0]"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
]


@pytest.mark.parametrize(("path", "fields", "param"), WRONG_TYPES)
async def test_wrong_types_are_401_without_a_key_and_400_with_one(
    fake_upstream: FakeUpstream, path: str, fields: dict[str, Any], param: str
) -> None:
    body = {**PATHS[path], **fields}
    bogus, good = await post_all(fake_upstream, [(path, body, BOGUS), (path, body, AUTH)])
    assert bogus.status_code == 401
    assert good.status_code == 400, good.text
    error = good.json()["error"]
    assert error["code"] == "invalid_request"
    if path == "/v1/responses":
        assert param in error["param"]
    else:
        assert param.split(".")[-1].split("[")[0] in error["message"]
    assert fake_upstream.requests == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": DEEP_MARK}]}),
        ("/v1/completions", {**COMPLETIONS, "prompt": [DEEP_MARK]}),
        ("/v1/embeddings", {"model": "gpt-test", "input": [DEEP_MARK]}),
        ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [DEEP_MARK]}]}),
        ("/v1/messages", {**MESSAGES, "tools": [{"name": "f", "input_schema": {"x": DEEP_MARK}}]}),
        ("/v1/responses", {**RESPONSES, "input": [DEEP_MARK]}),
        ("/v1/chat/completions", {**CHAT, "metadata": {"x": DEEP_MARK}}),
    ],
)
async def test_deep_nesting_is_401_without_a_key_and_400_with_one(
    fake_upstream: FakeUpstream, path: str, body: dict[str, Any]
) -> None:
    bogus, good = await post_all(fake_upstream, [(path, body, BOGUS), (path, body, AUTH)])
    assert bogus.status_code == 401
    assert good.status_code == 400, good.text
    assert fake_upstream.requests == []


# --- the estimate: any shape, bounded work, no recursion ------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]}, 11),
        ("chat/completions", {"messages": [{"content": [{"type": "text", "text": "x" * 40}]}]}, 11),
        ("chat/completions", {"messages": [{"content": [{"type": "image_url"}]}]}, 766),
        ("chat/completions", {"messages": [{"content": [{"type": 5, "text": "x" * 8}]}]}, 3),
        ("chat/completions", {"messages": 5}, 1),
        ("chat/completions", {"messages": "abc", "system": {"x": 1}}, 1),
        ("messages", {"messages": [{"content": [[[["x" * 40]]]]}], "system": "y" * 4}, 12),
        ("completions", {"prompt": [1, 2, 3, 4]}, 5),
        ("completions", {"prompt": nested(DEEP)}, 1),  # deeper than the walk goes: counts nothing
        ("responses", {"input": [{"content": [{"text": "x" * 8}]}], "instructions": "y" * 4}, 4),
        ("embeddings", {"input": None}, 1),
    ],
)
def test_estimate_handles_any_shape(endpoint: Any, body: dict[str, Any], expected: int) -> None:
    assert estimate_prompt_tokens(endpoint, body) == expected


def test_estimate_of_a_huge_token_list_is_bounded_but_counts_it() -> None:
    assert estimate_prompt_tokens("completions", {"prompt": [[7] * 3_000_000]}) == 3_000_001


def test_the_summary_line_names_a_few_kinds_cut_short(caplog: pytest.LogCaptureFixture) -> None:
    blocks = [{"type": f"kind-{i}-" + "x" * 500} for i in range(20)] + [{"type": "text", "text": "Hi"}]
    with caplog.at_level(logging.WARNING, logger="unigate.translate"):
        chat = messages_to_chat({"model": "m", "messages": [{"role": "user", "content": blocks}]})
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    [line] = [r.getMessage() for r in caplog.records if r.name == "unigate.translate"]
    assert line.count("kind-") == 8 and "12 more of other kinds" in line and len(line) < 1000
