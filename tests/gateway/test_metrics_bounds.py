"""/metrics: label sets bounded whatever callers and upstreams send, and the optional token / network guard."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import AUTH, CHAT, MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.metrics import KNOWN_ERROR_CODES, GatewayMetrics

NUM_VARIANTS = 25


async def _rejecting(request: Request) -> JSONResponse:
    """An upstream that rejects every request with an error code of the caller's choosing (from `user`)."""
    body = await request.json()
    error = {"message": "no", "type": "invalid_request_error", "code": body.get("user") or "x"}
    return JSONResponse({"error": error}, status_code=400)


def rejecting_upstream() -> Starlette:
    return Starlette(routes=[Route("/v1/{path:path}", _rejecting, methods=["POST"])])


def routing(fake_upstream: FakeUpstream, rejecting_url: str) -> dict[str, Any]:
    deployment = {"type": "openai", "api_key": "sk-up"}
    return {
        "models": [
            {"id": "gpt-test", "deployments": [{**deployment, "base_url": fake_upstream.base_url}]},
            {"id": "openai/*", "deployments": [{**deployment, "base_url": fake_upstream.base_url}]},
            {"id": "strict", "deployments": [{**deployment, "base_url": rejecting_url}]},
        ],
        "router": {"num_retries": 0},
    }


def series(text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def label_values(text: str, metric: str, label: str) -> set[str]:
    return set(re.findall(rf'^{metric}\{{[^}}]*{label}="([^"]*)"', text, flags=re.MULTILINE))


async def test_caller_chosen_models_and_upstream_codes_do_not_grow_the_exposition(
    fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> None:
    rejecting = gateway_server(rejecting_upstream())
    app = build_app(routing(fake_upstream, f"{rejecting.url}/v1"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:

            async def exposition_after(round_number: int) -> str:
                for i in range(NUM_VARIANTS):
                    tag = f"r{round_number}v{i}"
                    stream = {"stream": True} if i % 2 else {}
                    ok = await client.post(
                        "/v1/chat/completions", json={**CHAT, **stream, "model": f"openai/{tag}"}, headers=AUTH
                    )
                    assert ok.status_code == 200
                    rejected = await client.post(
                        "/v1/chat/completions", json={**CHAT, "model": "strict", "user": f"code_{tag}"}, headers=AUTH
                    )
                    assert rejected.status_code == 400 and rejected.json()["error"]["code"] == f"code_{tag}"
                    await client.post("/v1/chat/completions", json={**CHAT, "model": f"nope-{tag}"}, headers=AUTH)
                return (await client.get("/metrics")).text

            await client.get("/metrics")  # so that /metrics' own series exist in both snapshots
            first = await exposition_after(1)
            second = await exposition_after(2)
    assert series(second) == series(first)  # the same series, only the values moved
    models = label_values(second, "unigate_requests_total", "model")
    assert models == {"openai/*", "strict", ""}  # "": unknown models are answered before a model is known
    assert label_values(second, "unigate_tokens_total", "model") <= {"openai/*", "strict"}
    assert label_values(second, "unigate_time_to_first_token_seconds_count", "model") == {"openai/*"}
    assert label_values(second, "unigate_errors_total", "code") == {"other", "model_not_found"}


def test_model_labels_without_routing_and_with_it() -> None:
    unbound = GatewayMetrics()
    assert (unbound.model_label(""), unbound.model_label("x")) == ("", "other")
    metrics = GatewayMetrics(["a", "openai/*", "openai/gpt-*"])
    assert [metrics.model_label(m) for m in ("a", "openai/x", "openai/gpt-4", "b", "", "openai/")] == [
        "a",
        "openai/*",
        "openai/gpt-*",
        "other",
        "",
        "other",
    ]


def test_every_code_in_the_source_is_a_known_label() -> None:
    """A code raised anywhere in the packages but missing from KNOWN_ERROR_CODES would be counted as `other`."""
    root = Path(__file__).resolve().parents[2]
    found: set[str] = set()
    for package in ("gateway", "auth", "backends", "local_engine"):
        for path in (root / package).rglob("*.py"):
            found |= set(re.findall(r'\bcode\s*=\s*"([a-z_]+)"', path.read_text()))
    assert found, "the scan found no codes: has the source layout changed?"
    assert found - KNOWN_ERROR_CODES == set()


# --- the guard --------------------------------------------------------------------------------------------------


async def get_metrics(
    app: Starlette, *, client: tuple[str, int], headers: dict[str, str] | None = None
) -> httpx.Response:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return await http.get("/metrics", headers=headers)


LOCAL = ("127.0.0.1", 5000)
OUTSIDE = ("203.0.113.9", 5000)
TOKEN = "metrics-token-123"


@pytest.mark.parametrize(
    ("settings", "client", "headers", "status"),
    [
        ({}, OUTSIDE, None, 200),  # unset: open, as before
        ({"metrics_token": TOKEN}, LOCAL, None, 401),
        ({"metrics_token": TOKEN}, LOCAL, {"authorization": "Bearer wrong"}, 401),
        ({"metrics_token": TOKEN}, LOCAL, {"authorization": f"Basic {TOKEN}"}, 401),
        ({"metrics_token": TOKEN}, LOCAL, {"authorization": f"Bearer {MASTER}"}, 401),  # not the master key
        ({"metrics_token": TOKEN}, OUTSIDE, {"authorization": f"Bearer {TOKEN}"}, 200),
        ({"metrics_allow": "127.0.0.0/8, 10.0.0.0/8"}, LOCAL, None, 200),
        ({"metrics_allow": "127.0.0.0/8,10.0.0.0/8"}, ("10.1.2.3", 1), None, 200),
        ({"metrics_allow": "10.0.0.0/8"}, ("::ffff:10.1.2.3", 1), None, 200),
        ({"metrics_allow": "127.0.0.0/8"}, OUTSIDE, {"authorization": f"Bearer {TOKEN}"}, 403),
        ({"metrics_allow": "127.0.0.1", "metrics_token": TOKEN}, LOCAL, None, 401),
        ({"metrics_allow": "127.0.0.1", "metrics_token": TOKEN}, OUTSIDE, {"authorization": f"Bearer {TOKEN}"}, 403),
        ({"metrics_allow": "127.0.0.1", "metrics_token": TOKEN}, LOCAL, {"authorization": f"Bearer {TOKEN}"}, 200),
    ],
)
async def test_metrics_guard(
    fake_upstream: FakeUpstream,
    settings: dict[str, Any],
    client: tuple[str, int],
    headers: dict[str, str] | None,
    status: int,
) -> None:
    app = build_app(single_model(fake_upstream), **settings)
    response = await get_metrics(app, client=client, headers=headers)
    assert response.status_code == status, response.text
    if status == 200:
        assert "unigate_requests_in_flight" in response.text
    else:
        assert response.json()["error"]["code"] == "metrics_forbidden"
        assert TOKEN not in response.text and "unigate_" not in response.text


async def test_the_guard_covers_metrics_only_and_the_trailing_slash_form_serves_nothing(
    fake_upstream: FakeUpstream,
) -> None:
    app = build_app(single_model(fake_upstream), metrics_token=TOKEN)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=OUTSIDE)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            assert (await http.get("/metrics")).status_code == 401
            slash = await http.get("/metrics/")  # never rewritten (docs/gateway.md): no route, no metrics
            assert slash.status_code == 404 and "unigate_" not in slash.text
            assert (await http.get("/health/live")).status_code == 200
            assert (await http.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
