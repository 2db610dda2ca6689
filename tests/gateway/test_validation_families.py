"""The fields the three route families share are validated alike (`gateway.validate`), against a real gateway.

The same bad value for a shared concept (the output limit, temperature, stop strings, tools, ...) is sent to
`/v1/chat/completions`, `/v1/messages` and `/v1/responses`, each under that family's name for the field
(`max_tokens` / `max_output_tokens`, `stop` / `stop_sequences`, `user` / `metadata.user_id`): all three refuse it
with 400, the same `code`, a `param` naming the field as that client sent it, in the family's own envelope, and
nothing reaches the upstream. Models served natively (an Anthropic upstream, a Responses upstream) are checked the
same way, before routing. Good values pass on all three and reach a chat-completions upstream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fakes.app import AUTH, asgi_client, build_app, deployment, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from gateway import validate

FAMILIES = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
HI = [{"role": "user", "content": "Hi"}]
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"messages": HI},
    "messages": {"max_tokens": 16, "messages": HI},
    "responses": {"input": "Hi"},
}
TRANSLATED = {family: "gpt-test" for family in FAMILIES}
NATIVE = {"chat": "gpt-test", "messages": "native-messages", "responses": "native-responses"}

# concept -> each family's field, as its client sends it (a dotted name is a field inside an object)
FIELDS: dict[str, dict[str, str]] = {
    "output limit": {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"},
    "output limit (chat's newer name)": {
        "chat": "max_completion_tokens",
        "messages": "max_tokens",
        "responses": "max_output_tokens",
    },
    "stop strings": {"chat": "stop", "messages": "stop_sequences", "responses": "stop"},
    "end user": {"chat": "user", "messages": "metadata.user_id", "responses": "user"},
    **{
        name: dict.fromkeys(FAMILIES, name)
        for name in ("temperature", "top_p", "top_k", "stream", "n", "seed", "model", "tools", "tool_choice")
    },
    "metadata": dict.fromkeys(FAMILIES, "metadata"),
}


@dataclass(frozen=True)
class Bad:
    concept: str
    value: Any
    item: str = ""  # the part of the field at fault, appended to `param` (`[1]`, `.tier`)
    code: str = "invalid_request"


BAD = [
    *(Bad("output limit", value) for value in (True, False, 0, -1, 1.5, "16", [16], {}, 2**31)),
    *(Bad("output limit (chat's newer name)", value) for value in (True, 0)),
    *(Bad("temperature", value) for value in (True, -0.1, 2.5, "hot", [], 1e30)),
    *(Bad("top_p", value) for value in (True, -0.5, 1.5, "all")),
    *(Bad("top_k", value) for value in (True, -2, 0.5, "5", 2**21)),
    *(Bad("stop strings", value) for value in (1, True, {}, [1], [""], ["a", None], ["x"] * 5, ["x" * 1025])),
    *(Bad("stream", value) for value in ("true", 1, 0, [], {})),
    *(Bad("n", value) for value in (0, True, 1.5, "1", 129)),
    *(Bad("seed", value) for value in (True, 1.5, "7", 2**63, -(2**63) - 1)),
    *(Bad("model", value) for value in ("", "   ", 5, True, [], {"id": "gpt-test"})),
    *(Bad("tools", value) for value in ("all", {}, 5, True)),
    Bad("tools", [5], item="[0]"),
    Bad("tools", [{"type": "function"}, "f"], item="[1]"),
    *(Bad("tool_choice", value) for value in (5, True, "bogus", [], {}, {"type": 5})),
    *(Bad("metadata", value) for value in ("x", 5, [], True)),
    Bad("metadata", {"tier": 5}, item=".tier"),
    Bad("metadata", {"tier": ["gold"]}, item=".tier"),
    *(Bad("end user", value) for value in (5, True, [], {"id": "u"})),
]

GOOD: dict[str, list[Any]] = {
    "output limit": [1, 16],
    "temperature": [0, 0.5, 1],
    "top_p": [0, 0.9, 1],
    "top_k": [-1, 0, 40],
    "stop strings": [["END"], ["a", "b", "c", "d"]],
    "stream": [False, True],
    "n": [1],
    "seed": [0, -(2**63), 2**63 - 1],
    "tools": [[]],
    "metadata": [{}, {"tier": "gold"}],
    "end user": ["user-1"],
}
# The good values a chat-completions upstream then receives, under chat's name, from every family.
FORWARDED = {"output limit": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
FORWARDED |= {"stop strings": "stop", "seed": "seed", "end user": "user"}


@dataclass
class Gateway:
    client: httpx.Client
    upstream: FakeUpstream


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    with FakeUpstream() as upstream:
        dead = "http://127.0.0.1:9/v1"  # native models: a refused request must never get this far
        routing = {
            "models": [
                {"id": "gpt-test", "deployments": [deployment(upstream)]},
                {"id": "native-messages", "deployments": [{"type": "anthropic", "base_url": dead, "api_key": "k"}]},
                {"id": "native-responses", "deployments": [deployment(upstream, native_responses=True)]},
            ],
            "router": {"num_retries": 0},
        }
        with ThreadedServer(build_app(routing)) as server, httpx.Client(base_url=server.url, timeout=30) as client:
            yield Gateway(client, upstream)


@pytest.fixture(autouse=True)
def _reset(gateway: Gateway) -> None:
    gateway.upstream.reset()


def body_with(family: str, field: str, value: Any, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, **BODIES[family]}
    if "." in field:
        outer, inner = field.split(".")
        body[outer] = {inner: value}
    else:
        body[field] = value
    return body


def post(gateway: Gateway, family: str, body: dict[str, Any]) -> httpx.Response:
    return gateway.client.post(PATHS[family], json=body, headers=AUTH)


def error_of(family: str, response: httpx.Response) -> dict[str, Any]:
    """The error object in the family's envelope: Anthropic's for /v1/messages, OpenAI's otherwise."""
    body = response.json()
    if family == "messages":
        assert body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize("models", [TRANSLATED, NATIVE], ids=["translated", "native"])
@pytest.mark.parametrize("bad", BAD, ids=lambda bad: f"{bad.concept}={bad.value!r}{bad.item}"[:60])
def test_every_family_refuses_the_same_bad_value_alike(gateway: Gateway, bad: Bad, models: dict[str, str]) -> None:
    refused: dict[str, tuple[str, str]] = {}
    for family in FAMILIES:
        field = FIELDS[bad.concept][family]
        response = post(gateway, family, body_with(family, field, bad.value, models[family]))
        assert response.status_code == 400, (family, response.text)
        error = error_of(family, response)
        refused[family] = (error["code"], error["param"])
        assert error["param"] == field + bad.item, (family, error)
        assert f"`{error['param']}`" in error["message"], (family, error)
    assert {code for code, _ in refused.values()} == {bad.code}, refused
    assert gateway.upstream.requests == []


@pytest.mark.parametrize("family", ["messages", "responses"])
def test_more_than_one_choice_is_unsupported_where_the_family_answers_once(gateway: Gateway, family: str) -> None:
    response = post(gateway, family, body_with(family, "n", 2, "gpt-test"))
    assert response.status_code == 400, response.text
    error = error_of(family, response)
    assert (error["code"], error["param"]) == ("unsupported_parameter", "n")
    assert post(gateway, "chat", body_with("chat", "n", 2, "gpt-test")).status_code == 200


@pytest.mark.parametrize(
    ("concept", "value"), [(concept, value) for concept, values in GOOD.items() for value in values]
)
def test_every_family_accepts_the_same_good_value(gateway: Gateway, concept: str, value: Any) -> None:
    for family in FAMILIES:
        gateway.upstream.reset()
        response = post(gateway, family, body_with(family, FIELDS[concept][family], value, "gpt-test"))
        assert response.status_code == 200, (family, response.text)
        [request] = gateway.upstream.requests
        assert request.path.endswith("/chat/completions")
        if concept in FORWARDED:
            assert request.body[FORWARDED[concept]] == value, (family, request.body)


@pytest.mark.parametrize(
    ("family", "tool_choice"),
    [
        ("chat", "auto"),
        ("chat", {"type": "function", "function": {"name": "f"}}),
        ("responses", "required"),
        ("responses", {"type": "function", "name": "f"}),
        ("messages", {"type": "any"}),
        ("messages", {"type": "tool", "name": "f"}),
    ],
)
def test_each_family_keeps_its_own_tool_choice_forms(gateway: Gateway, family: str, tool_choice: Any) -> None:
    tools = {
        "chat": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "messages": [{"name": "f", "input_schema": {"type": "object"}}],
        "responses": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    }
    body = {**body_with(family, "tool_choice", tool_choice, "gpt-test"), "tools": tools[family]}
    response = post(gateway, family, body)
    assert response.status_code == 200, response.text
    [request] = gateway.upstream.requests
    assert request.body["tools"][0]["function"]["name"] == "f"
    assert request.body["tool_choice"] in ("auto", "required", {"type": "function", "function": {"name": "f"}})


def test_anthropic_tool_choice_is_an_object_not_a_string(gateway: Gateway) -> None:
    response = post(gateway, "messages", body_with("messages", "tool_choice", "auto", "gpt-test"))
    assert response.status_code == 400
    assert error_of("messages", response)["param"] == "tool_choice"


ROUTE_BODIES = [
    ("/v1/chat/completions", {"messages": HI}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/embeddings", {"input": "Hi"}),
    ("/v1/messages", {"max_tokens": 16, "messages": HI}),
    ("/v1/messages/count_tokens", {"messages": HI}),
    ("/v1/responses", {"input": "Hi"}),
]


@pytest.mark.parametrize(("path", "body"), ROUTE_BODIES, ids=[path for path, _ in ROUTE_BODIES])
async def test_model_is_checked_once_per_request(
    fake_upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch, path: str, body: dict[str, Any]
) -> None:
    calls: list[str] = []
    real = validate.require_model

    def counting(body: Any) -> str:
        calls.append(path)
        return real(body)

    monkeypatch.setattr(validate, "require_model", counting)
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post(path, json={"model": "gpt-test", **body}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert calls == [path]
