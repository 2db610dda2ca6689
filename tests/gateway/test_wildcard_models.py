"""`GET /v1/models` lists what wildcard routes serve (issue 36): each wildcard deployment's upstream `/v1/models`
under the route's prefix, cached, bounded, and left out (never failing the listing) when the upstream 500s or hangs.
Real fake upstreams on loopback; the gateway in-process with its lifespan running."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, build_app, deployment
from fakes.upstream import Behavior, FakeUpstream

from backends.openai import OpenAIBackend
from gateway.router import Router
from gateway.routing_config import parse_routing
from gateway.wildcard_models import WildcardModels

KEY = "sk-ug-only-openai-x"


def model_listings(upstream: FakeUpstream) -> int:
    return sum(1 for r in upstream.requests if r.method == "GET" and r.path == "/v1/models")


@pytest.fixture
def upstreams(fake_upstream_factory: Any) -> dict[str, FakeUpstream]:
    good, failing, stuck = fake_upstream_factory(), fake_upstream_factory(), fake_upstream_factory()
    good.model_ids = ["gpt-x", "gpt-y"]
    failing.models_behavior = Behavior(mode="status", status=500)
    stuck.models_behavior = Behavior(mode="hang")
    return {"good": good, "failing": failing, "stuck": stuck}


def routing(upstreams: dict[str, FakeUpstream]) -> dict[str, Any]:
    return {
        "models": [
            {"id": "gpt-test", "deployments": [deployment(upstreams["good"])]},
            {"id": "openai/*", "deployments": [deployment(upstreams["good"])]},
            {"id": "broken/*", "deployments": [deployment(upstreams["failing"])]},
            {"id": "stuck/*", "deployments": [deployment(upstreams["stuck"])]},
        ]
    }


async def test_wildcard_routes_list_their_upstreams_models(
    upstreams: dict[str, FakeUpstream], caplog: pytest.LogCaptureFixture
) -> None:
    access = RecordingAccess(master_key=MASTER, keys={KEY: ("openai/gpt-x",)})
    app = build_app(routing(upstreams), access=access, health_probe_timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="unigate.models"):
        async with asgi_client(app) as client:
            first = await client.get("/v1/models", headers=AUTH)
            second = await client.get("/v1/models", headers=AUTH)
            anthropic = await client.get("/v1/models", headers={**AUTH, "anthropic-version": "2023-06-01"})
            restricted = await client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"})
            served = await client.post(
                "/v1/chat/completions",
                json={"model": "openai/gpt-x", "messages": [{"role": "user", "content": "hi"}]},
                headers=AUTH,
            )
    assert first.status_code == second.status_code == 200
    ids = [model["id"] for model in first.json()["data"]]
    assert ids == ["gpt-test", "openai/gpt-x", "openai/gpt-y"]  # the failing and the hanging upstream: left out
    assert first.json()["data"][1] == {
        "id": "openai/gpt-x",
        "object": "model",
        "created": first.json()["data"][0]["created"],
        "owned_by": "unigate",
        "aliases": [],
    }
    assert [model["id"] for model in second.json()["data"]] == ids
    assert [model["id"] for model in anthropic.json()["data"]] == ids
    assert [model["id"] for model in restricted.json()["data"]] == ["openai/gpt-x"]
    assert served.status_code == 200 and upstreams["good"].requests[-1].body["model"] == "gpt-x"
    # Each upstream was asked once: the list (and each failure) is cached, and four listings share it.
    assert [model_listings(upstreams[name]) for name in ("good", "failing", "stuck")] == [1, 1, 1]
    warnings = [record.getMessage() for record in caplog.records]
    assert any("broken/*#0" in line and "upstream_error" in line for line in warnings), warnings
    assert any("stuck/*#0" in line and "timeout" in line for line in warnings), warnings
    assert all("127.0.0.1" not in line for line in warnings)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_cache_expires_and_bounds_the_count(fake_upstream: FakeUpstream) -> None:
    """Asked again after `ttl_s` (a failure: after `failure_ttl_s`); at most `max_ids` ids from one upstream; a
    deployment that maps names (`model: vendor/*`) lists what its requests reach; an explicit id or a more specific
    wildcard keeps the models it owns."""
    fake_upstream.model_ids = ["vendor/m1", "vendor/m2", "other", "vendor/m3", "vendor/special-1", "vendor/m9"]
    config = parse_routing(
        {
            "models": [
                {"id": "mapped/m2", "deployments": [deployment(fake_upstream, name="explicit")]},
                {"id": "mapped/*", "deployments": [deployment(fake_upstream, name="mapped", model="vendor/*")]},
                {"id": "mapped/special-*", "deployments": [deployment(fake_upstream, name="special", model="x")]},
            ]
        },
        source="test.yaml",
    )
    backends = {
        d.name: OpenAIBackend(d.name, base_url=d.base_url or "", api_key=None)
        for m in config.models
        for d in m.deployments
    }
    router = Router(config, backends)
    clock = Clock()
    catalog = WildcardModels(timeout_s=5, ttl_s=60, failure_ttl_s=10, max_ids=5, clock=clock)
    try:
        assert await catalog.public_ids(router) == [
            "mapped/m1",
            "mapped/m3",
        ]  # 5 ids read; m2 and special-1 routed elsewhere
        clock.now += 59
        fake_upstream.model_ids = ["vendor/new"]
        assert await catalog.public_ids(router) == ["mapped/m1", "mapped/m3"]  # cached
        assert model_listings(fake_upstream) == 1  # the `special` deployment maps every name to one model: not asked
        clock.now += 2
        fake_upstream.models_behavior = Behavior(mode="status", status=503)
        assert await catalog.public_ids(router) == []  # expired, asked again, failed: left out
        fake_upstream.models_behavior = None
        clock.now += 9
        assert await catalog.public_ids(router) == []  # the failure is remembered for failure_ttl_s
        clock.now += 2
        assert await catalog.public_ids(router) == ["mapped/new"]
        assert model_listings(fake_upstream) == 3
        clock.now += 61
        fake_upstream.models_behavior = Behavior(mode="html")  # a login page, not a model list
        assert await catalog.public_ids(router) == []
        assert model_listings(fake_upstream) == 4
    finally:
        for backend in backends.values():
            await backend.aclose()


def test_the_documented_bounds() -> None:
    """docs/gateway.md: a list is kept 5 minutes, a failure 30 s, at most 1,000 ids per upstream."""
    catalog = WildcardModels(timeout_s=3)
    assert (catalog.ttl_s, catalog.failure_ttl_s, catalog.max_ids) == (300, 30, 1000)
