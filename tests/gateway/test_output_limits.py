"""Output limits for upstreams whose context length the routing file gives (issue 20, item 1): a max_tokens that
does not fit next to the (estimated) prompt is lowered, said in `x-unigate-max-tokens-clamped` and a debug line,
on the OpenAI, Anthropic and Responses routes alike; admission reserves the lowered figure. The local engine's own
clamp is tested in tests/backends/test_local_output_limits.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, build_app, deployment
from fakes.upstream import FakeUpstream

from auth.base import NO_COST, Admission, BudgetCost
from gateway.output_limits import CLAMP_BYTES_PER_TOKEN, CLAMP_HEADER
from gateway.routing_config import RoutingConfigError, parse_routing

CONTEXT = 4000
PROMPT = "Summarise the plot of Hamlet in one line."


class ReservingAccess(RecordingAccess):
    """Also records what each admission reserved."""

    def __init__(self) -> None:
        super().__init__(master_key=MASTER)
        self.reserved: list[int] = []

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        self.reserved.append(estimated_tokens)
        return await super().admit(credential, model=model, estimated_tokens=estimated_tokens, request_id=request_id)


def routing(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return {"models": [{"id": "gpt-test", "deployments": [deployment(upstream, **extra)]}]}


SURFACES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32000}, "max_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32000}, "max_tokens"),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 32000}, "max_tokens"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("path", "fields", "sent_field"), SURFACES, ids=["chat", "messages", "responses"])
async def test_an_output_limit_too_big_for_the_context_is_lowered(
    fake_upstream: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    path: str,
    fields: dict[str, Any],
    sent_field: str,
    stream: bool,
) -> None:
    app = build_app(routing(fake_upstream, context_length=CONTEXT))
    with caplog.at_level(logging.DEBUG, logger="unigate.pipeline"):
        async with asgi_client(app) as client:
            response = await client.post(path, json={"model": "gpt-test", "stream": stream, **fields}, headers=AUTH)
    assert response.status_code == 200, response.text
    [sent] = fake_upstream.requests
    served = sent.body[sent_field]
    # The estimate counts every byte of the body sent, so it errs high: the room it leaves is below the real one.
    assert 0 < served < CONTEXT - len(PROMPT) // CLAMP_BYTES_PER_TOKEN
    assert response.headers[CLAMP_HEADER] == f"32000 -> {served}"
    [line] = [r.getMessage() for r in caplog.records if "max_tokens clamped" in r.getMessage()]
    assert line.startswith(f"max_tokens clamped 32000 -> {served} for gpt-test#0") and "(estimated)" in line


async def test_a_limit_that_fits_and_a_deployment_without_a_context_are_left_alone(fake_upstream: FakeUpstream) -> None:
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1000}
    for extra, max_tokens in (({"context_length": CONTEXT}, 1000), ({}, 32000)):
        fake_upstream.reset()
        async with asgi_client(build_app(routing(fake_upstream, **extra))) as client:
            response = await client.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens}, headers=AUTH)
        assert response.status_code == 200 and CLAMP_HEADER not in response.headers
        assert fake_upstream.requests[0].body["max_tokens"] == max_tokens


async def test_clamp_max_tokens_false_sends_the_request_as_it_is(fake_upstream: FakeUpstream) -> None:
    app = build_app(routing(fake_upstream, context_length=CONTEXT, clamp_max_tokens=False))
    async with asgi_client(app) as client:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32000}
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status_code == 200 and CLAMP_HEADER not in response.headers
    assert fake_upstream.requests[0].body["max_tokens"] == 32000


async def test_a_prompt_whose_estimate_does_not_fit_is_left_to_the_upstream(fake_upstream: FakeUpstream) -> None:
    app = build_app(routing(fake_upstream, context_length=100))
    async with asgi_client(app) as client:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 50}
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert CLAMP_HEADER not in response.headers and fake_upstream.requests[0].body["max_tokens"] == 50


async def test_admission_reserves_the_room_the_context_leaves(fake_upstream: FakeUpstream) -> None:
    access = ReservingAccess()
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32000, "n": 2}
    for extra in ({"context_length": CONTEXT}, {}):
        async with asgi_client(build_app(routing(fake_upstream, **extra), access=access)) as client:
            assert (await client.post("/v1/chat/completions", json=body, headers=AUTH)).status_code == 200
    estimate = len(PROMPT) // 4 + 1  # the gateway's admission estimate (characters / 4)
    assert access.reserved == [estimate + 2 * (CONTEXT - estimate), estimate + 2 * 32000]


@pytest.mark.parametrize(
    ("fields", "num_completions"),
    [({}, 1), ({"max_tokens": None}, 1), ({"n": 3}, 3), ({"prompt": ["Say hi", "Say yo"], "n": 2}, 4)],
)
async def test_a_completions_request_without_a_limit_reserves_the_16_tokens_it_can_produce(
    fake_upstream: FakeUpstream, fields: dict[str, Any], num_completions: int
) -> None:
    """Legacy completions stop at 16 tokens when the request sets no `max_tokens` (OpenAI's default, vLLM's and the
    local engine's): admission reserves 16 per completion (n × prompts), not the 1024 of chat, messages and
    responses."""
    access = ReservingAccess()
    async with asgi_client(build_app(routing(fake_upstream), access=access)) as client:
        body = {"model": "gpt-test", "prompt": "Say hi", **fields}
        assert (await client.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
        chat = {"model": "gpt-test", "messages": [{"role": "user", "content": "Say hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat, headers=AUTH)).status_code == 200
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    estimate = len("".join(prompts)) // 4 + 1  # the gateway's admission estimate (characters / 4)
    assert access.reserved == [estimate + 16 * num_completions, len("Say hi") // 4 + 1 + 1024]
    assert "max_tokens" not in fake_upstream.requests[0].body or fake_upstream.requests[0].body["max_tokens"] is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"clamp_max_tokens": True}, "needs the upstream model's `context_length`"),
        ({"default_max_tokens": 512}, "applies to `type: local` deployments only"),
    ],
)
def test_routing_file_mistakes_are_named(fields: dict[str, Any], message: str) -> None:
    upstream = {"type": "openai", "base_url": "http://127.0.0.1:9/v1", **fields}
    with pytest.raises(RoutingConfigError, match=message):
        parse_routing({"models": [{"id": "m", "deployments": [upstream]}]}, source="t.yaml")
    local = {"type": "local", "context_length": 4096}
    with pytest.raises(RoutingConfigError, match="UNIGATE_ENGINE__MAX_MODEL_LEN"):
        parse_routing({"models": [{"id": "m", "deployments": [local]}]}, source="t.yaml")


def test_clamping_defaults() -> None:
    config = parse_routing(
        {
            "models": [
                {
                    "id": "m",
                    "deployments": [
                        {"type": "local"},
                        {"type": "local", "clamp_max_tokens": False},
                        {"type": "openai", "base_url": "http://127.0.0.1:9/v1"},
                        {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "context_length": 8192},
                    ],
                }
            ]
        },
        source="t.yaml",
    )
    assert [d.clamps_max_tokens for d in config.models[0].deployments] == [True, False, False, True]
