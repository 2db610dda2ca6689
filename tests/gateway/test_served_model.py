"""An answer names the public id of the model that served it — a fallback's own id, an alias's id — in every family,
streaming or not, as OpenAI names the model that served; the upstream's own model name is in
`x-unigate-upstream-model` (docs/gateway.md, routing file)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from fakes.anthropic_upstream import UPSTREAM_KEY, FakeAnthropic
from fakes.app import AUTH, asgi_client, build_app, deployment
from fakes.server import ThreadedServer
from fakes.upstream import Behavior, FakeUpstream

from gateway.normalize import UPSTREAM_MODEL_HEADER, name_model, upstream_model_header

PROMPT = [{"role": "user", "content": "Hello there"}]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": PROMPT},
    "/v1/completions": {"prompt": "Hello there"},
    "/v1/messages": {"messages": PROMPT, "max_tokens": 16},
    "/v1/responses": {"input": "Hello there"},
}


def named_models(response: httpx.Response, *, stream: bool) -> list[Any]:
    """Every `model` the answer names: the body's, or each stream event's (Messages: `message_start`'s message;
    Responses: each event's `response`)."""
    if not stream:
        return [response.json()["model"]]
    names = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line[6:])
        holder = event.get("message") if event.get("type") == "message_start" else event.get("response", event)
        if isinstance(holder, dict) and "model" in holder:
            names.append(holder["model"])
    return names


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", list(BODIES))
async def test_a_fallbacks_answer_names_the_fallback_not_its_upstream(
    fake_upstream_factory: Any, path: str, stream: bool
) -> None:
    primary, backup = fake_upstream_factory(), fake_upstream_factory()
    primary.behave(Behavior(mode="status", status=500))
    routing = {
        "models": [
            {"id": "cheap", "deployments": [deployment(primary)]},
            {"id": "pricey", "deployments": [deployment(backup, model="upstream-pricey")]},
        ],
        "fallbacks": {"cheap": ["pricey"]},
        "router": {"num_retries": 0},
    }
    async with asgi_client(build_app(routing)) as client:
        body = {"model": "cheap", "stream": stream, **BODIES[path]}
        response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert backup.requests[0].body["model"] == "upstream-pricey" and len(primary.requests) == 1
    names = named_models(response, stream=stream)
    assert names and set(names) == {"pricey"}, names
    assert response.headers[UPSTREAM_MODEL_HEADER] == "upstream-pricey"
    assert "upstream-pricey" not in response.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_alias_is_answered_with_the_models_id(fake_upstream: FakeUpstream, stream: bool) -> None:
    routing = {
        "models": [{"id": "gpt-test", "aliases": ["fast"], "deployments": [deployment(fake_upstream, model="up")]}]
    }
    async with asgi_client(build_app(routing)) as client:
        body = {"model": "fast", "stream": stream, "messages": PROMPT}
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert set(named_models(response, stream=stream)) == {"gpt-test"}
    assert response.headers[UPSTREAM_MODEL_HEADER] == "up"


@pytest.fixture
def claude() -> Iterator[ThreadedServer]:
    server = ThreadedServer(FakeAnthropic().app(), lifespan="off").start()
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions", "/v1/responses"])
async def test_an_anthropic_upstreams_answer_names_the_public_id(
    claude: ThreadedServer, path: str, stream: bool
) -> None:
    """Native Messages (the `message_start` event's message too) and the translations from it alike."""
    upstream = {"type": "anthropic", "base_url": claude.url + "/v1", "api_key": UPSTREAM_KEY, "model": "claude-ok"}
    async with asgi_client(build_app({"models": [{"id": "claude", "deployments": [upstream]}]})) as client:
        body = {"model": "claude", "stream": stream, **BODIES[path]}
        response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    names = named_models(response, stream=stream)
    assert names and set(names) == {"claude"}, names
    assert response.headers[UPSTREAM_MODEL_HEADER] == "claude-ok"


def test_name_model_reaches_every_familys_field_and_the_header_takes_only_a_sane_name() -> None:
    responses_event = {"type": "response.created", "response": {"model": "gpt-4o-2024-08-06", "output": []}}
    assert name_model(responses_event, "gpt-4o") == "gpt-4o-2024-08-06"
    assert responses_event["response"]["model"] == "gpt-4o"
    delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}}
    assert name_model(delta, "x") is None and "model" not in delta
    assert name_model({"input_tokens": 3}, "x") is None  # count_tokens: nothing names a model
    assert upstream_model_header("gpt-4o\r\nx-evil: 1") is None and upstream_model_header(7) is None
    assert upstream_model_header("x" * 257) is None and upstream_model_header("vendor/m-1.5") == "vendor/m-1.5"
