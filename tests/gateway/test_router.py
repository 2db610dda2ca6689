"""Retries, fallbacks, cooldown and load balancing, against real fake upstreams."""

from __future__ import annotations

from typing import Any

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, CHAT, MASTER, asgi_client, build_app, deployment
from fakes.upstream import Behavior, FakeUpstream

from gateway.cooldowns import MAX_MODEL_STATES as _MAX_MODEL_STATES
from gateway.errors import BackendError, NotFoundError
from gateway.router import Router
from gateway.routing_config import parse_routing

FAST_RETRIES = {"num_retries": 2, "retry_backoff_s": 0.001, "max_backoff_s": 0.01, "cooldown_s": 60, "max_fails": 2}


def two_deployments(a: FakeUpstream, b: FakeUpstream, **router: Any) -> dict[str, Any]:
    return {
        "models": [{"id": "gpt-test", "deployments": [deployment(a, name="a"), deployment(b, name="b")]}],
        "router": {**FAST_RETRIES, **router},
    }


async def test_retry_on_5xx_then_success(fake_upstream: FakeUpstream) -> None:
    fake_upstream.queue(Behavior(mode="status", status=503), Behavior(mode="status", status=500))
    routing = {
        "models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream)]}],
        "router": {**FAST_RETRIES, "max_fails": 5},
    }
    async with asgi_client(build_app(routing)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 200
    assert len(fake_upstream.requests) == 3


async def test_no_retry_on_client_error(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="status", status=400)
    routing = {
        "models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream)]}],
        "router": {**FAST_RETRIES, "max_fails": 5},
    }
    async with asgi_client(build_app(routing)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 400
    assert len(fake_upstream.requests) == 1


async def test_retry_moves_to_the_other_deployment(fake_upstream_factory: Any) -> None:
    a, b = fake_upstream_factory(), fake_upstream_factory()
    a.behave(mode="drop")
    async with asgi_client(build_app(two_deployments(a, b))) as client:
        # The pick among idle deployments is random: send until `a` has failed max_fails=2 times.
        num_sent = 0
        while len(a.requests) < 2:
            assert num_sent < 40, "the router never picked deployment `a`"
            response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            num_sent += 1
            assert response.status_code == 200  # every failure on `a` was retried on `b`
        assert len(a.requests) == 2 and len(b.requests) == num_sent
        for _ in range(4):
            response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert response.status_code == 200
    assert len(b.requests) == num_sent + 4
    assert len(a.requests) == 2  # `a` cooled down and saw nothing more


async def test_fallback_model_after_retries(fake_upstream_factory: Any) -> None:
    primary, backup = fake_upstream_factory(), fake_upstream_factory()
    primary.behave(mode="status", status=500)
    routing = {
        "models": [
            {"id": "gpt-test", "deployments": [deployment(primary)]},
            {"id": "backup-model", "deployments": [deployment(backup, model="upstream-backup")]},
        ],
        "fallbacks": {"gpt-test": ["backup-model"]},
        "router": {**FAST_RETRIES, "max_fails": 10},
    }
    async with asgi_client(build_app(routing)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 200
    assert len(primary.requests) == 3  # 1 + num_retries
    assert backup.requests[0].body["model"] == "upstream-backup"


async def test_fallback_on_malformed_but_not_on_bad_request(fake_upstream_factory: Any) -> None:
    primary, backup = fake_upstream_factory(), fake_upstream_factory()
    routing = {
        "models": [
            {"id": "gpt-test", "deployments": [deployment(primary)]},
            {"id": "backup-model", "deployments": [deployment(backup)]},
        ],
        "fallbacks": {"gpt-test": ["backup-model"]},
        "router": FAST_RETRIES,
    }
    async with asgi_client(build_app(routing)) as client:
        primary.behave(mode="malformed", variant="no_choices")
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        assert len(primary.requests) == 1  # malformed is not retried on the same model, but falls back
        primary.behave(mode="status", status=400)
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 400
        assert len(backup.requests) == 1  # the caller's own mistake is not sent to the fallback


async def test_cooldown_then_503_with_retry_after(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="status", status=500)
    routing = {
        "models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream)]}],
        "router": {**FAST_RETRIES, "num_retries": 0, "max_fails": 2, "cooldown_s": 30},
    }
    async with asgi_client(build_app(routing)) as client:
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 502
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_cooling_down"
    assert 1 <= int(response.headers["retry-after"]) <= 30
    assert len(fake_upstream.requests) == 2


async def test_429_cools_down_for_retry_after_and_passes_it_through(fake_upstream_factory: Any) -> None:
    a, b = fake_upstream_factory(), fake_upstream_factory()
    a.behave(mode="status", status=429, retry_after="5")
    b.behave(mode="status", status=429, retry_after="5")
    async with asgi_client(build_app(two_deployments(a, b))) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "5"
    assert len(a.requests) == 1 and len(b.requests) == 1  # each tried once, then both cooling


async def test_upstream_lease_acquired_and_released(fake_upstream: FakeUpstream) -> None:
    access = RecordingAccess(master_key=MASTER)
    routing = {"models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream, max_in_flight=3)]}]}
    async with asgi_client(build_app(routing, access=access)) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
        fake_upstream.behave(mode="status", status=500)
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 502
    assert access.acquired == access.released
    assert len(access.acquired) == 4  # one success + 1 + 2 retries


async def test_at_capacity_is_not_retried_on_the_same_deployment(fake_upstream: FakeUpstream) -> None:
    access = RecordingAccess(master_key=MASTER, full={"a"})
    routing = {
        "models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream, name="a", max_in_flight=1)]}],
        "router": FAST_RETRIES,
    }
    async with asgi_client(build_app(routing, access=access)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_at_capacity"
    assert access.acquired == ["a"]  # one pool_timeout wait, not 1 + num_retries of them
    assert fake_upstream.requests == []


async def test_at_capacity_moves_to_another_deployment_then_the_fallback(fake_upstream_factory: Any) -> None:
    a, b, backup = fake_upstream_factory(), fake_upstream_factory(), fake_upstream_factory()
    access = RecordingAccess(master_key=MASTER, full={"a"})
    routing = {
        "models": [
            {
                "id": "gpt-test",
                "deployments": [deployment(a, name="a", max_in_flight=1), deployment(b, name="b", max_in_flight=1)],
            },
            {"id": "backup-model", "deployments": [deployment(backup, name="backup", max_in_flight=1)]},
        ],
        "fallbacks": {"gpt-test": ["backup-model"]},
        "router": FAST_RETRIES,
    }
    async with asgi_client(build_app(routing, access=access)) as client:
        for _ in range(6):  # the first pick is random: whichever it is, `a` is tried at most once per request
            before = len(access.acquired)
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
            assert access.acquired[before:].count("a") <= 1
        assert len(b.requests) == 6 and a.requests == [] and backup.requests == []
        access.full.add("b")
        before = len(access.acquired)
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
    assert sorted(access.acquired[before:]) == ["a", "b", "backup"]
    assert len(backup.requests) == 1


class CountingBackend:
    def __init__(self, name: str) -> None:
        self.name = name

    def supports(self, endpoint: str) -> bool:
        return True

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def router_for(weights: list[float]) -> Router:
    models = [
        {
            "id": "m",
            "deployments": [
                {"type": "openai", "base_url": "http://x/v1", "name": f"d{i}", "weight": w}
                for i, w in enumerate(weights)
            ],
        }
    ]
    config = parse_routing({"models": models}, source="t")
    return Router(config, {f"d{i}": CountingBackend(f"d{i}") for i in range(len(weights))})  # type: ignore[misc]


def test_pick_prefers_least_in_flight_per_weight() -> None:
    router = router_for([1, 3])
    route = router.routes[0]
    d0, d1 = route.deployments
    d0.num_in_flight, d1.num_in_flight = 1, 2  # 1/1 > 2/3: d1 is less loaded per unit of weight
    assert all(router.pick(route) is d1 for _ in range(20))


def test_pick_is_weighted_between_ties() -> None:
    router = router_for([1, 9])
    route = router.routes[0]
    picks = [router.pick(route).name for _ in range(2000)]  # type: ignore[union-attr]
    assert 0.8 < picks.count("d1") / len(picks) < 0.97


def one_deployment_router(model_id: str, now: list[float], **router: Any) -> Router:
    """A router over one model with one deployment `d0`, on a clock the test moves (`now[0]`)."""
    config = parse_routing(
        {
            "models": [{"id": model_id, "deployments": [{"type": "openai", "base_url": "http://x/v1", "name": "d0"}]}],
            "router": router,
        },
        source="t",
    )
    return Router(config, {"d0": CountingBackend("d0")}, clock=lambda: now[0])  # type: ignore[dict-item]


def test_cooldown_skips_and_returns() -> None:
    now = [100.0]
    router = one_deployment_router("m", now, max_fails=2, cooldown_s=10)
    route = router.routes[0]
    error = BackendError("boom", code="upstream_error")
    router.record_failure(route.deployments[0], error)
    assert router.pick(route) is route.deployments[0]
    router.record_failure(route.deployments[0], error)
    assert router.pick(route) is None
    now[0] += 10.5
    assert router.pick(route) is route.deployments[0]


def test_per_model_cooldowns_of_a_wildcard_route_are_bounded_and_expire() -> None:
    """Any model name reaches a wildcard route: its per-model records stay at most `_MAX_MODEL_STATES` (expired
    ones, then the oldest, make room), and a cooled model comes back after `cooldown_s` like a deployment."""
    now = [100.0]
    router = one_deployment_router("oa/*", now, max_fails=1, cooldown_s=10)
    route, [d0] = router.routes[0], router.routes[0].deployments
    error = BackendError("boom", code="upstream_error")
    router.record_failure(d0, error, model="oa/hot")
    assert router.pick(route, model="oa/hot") is None and router.pick(route, model="oa/cold") is d0
    assert router.pick(route) is d0  # the deployment itself is fine
    now[0] += 10.5
    for i in range(3 * _MAX_MODEL_STATES):
        router.record_failure(d0, error, model=f"oa/m{i}")
    assert len(d0.models) <= _MAX_MODEL_STATES
    assert router.pick(route, model=f"oa/m{3 * _MAX_MODEL_STATES - 1}") is None  # the newest is still cooling
    now[0] += 10.5
    assert router.pick(route, model=f"oa/m{3 * _MAX_MODEL_STATES - 1}") is d0


def test_wildcard_and_alias_resolution() -> None:
    config = parse_routing(
        {
            "models": [
                {
                    "id": "gpt-4o-mini",
                    "aliases": ["fast"],
                    "deployments": [{"type": "openai", "base_url": "http://x/v1"}],
                },
                {"id": "openai/*", "deployments": [{"type": "openai", "base_url": "http://y/v1"}]},
            ]
        },
        source="t",
    )
    router = Router(config, {d.name: CountingBackend(d.name) for m in config.models for d in m.deployments})  # type: ignore[misc]
    alias = router.resolve("fast")
    assert alias.model_id == "gpt-4o-mini" and alias.upstream_model(alias.route.deployments[0]) == "gpt-4o-mini"
    wild = router.resolve("openai/gpt-4.1")
    assert wild.model_id == "openai/gpt-4.1" and wild.upstream_model(wild.route.deployments[0]) == "gpt-4.1"
    with pytest.raises(Exception, match="Did you mean 'gpt-4o-mini'"):
        router.resolve("gpt-4o-mni")
    assert router.find("openai/") is None
    with pytest.raises(NotFoundError) as caught:
        router.resolve("opnai/gpt-4.1")
    assert "Did you mean 'openai/<model>'?" in caught.value.message  # the wildcard's form, not a fake model id
    assert "openai/*" not in caught.value.message


# --- a 429 from a model's only deployment (docs/gateway.md: num_retries retries 429s) ----------------------------

ONE_DEPLOYMENT_RETRIES = {"num_retries": 2, "retry_backoff_s": 0.001, "max_backoff_s": 2.0, "cooldown_s": 30}


def only_deployment(upstream: FakeUpstream, **router: Any) -> dict[str, Any]:
    return {
        "models": [{"id": "gpt-test", "deployments": [deployment(upstream)]}],
        "router": {**ONE_DEPLOYMENT_RETRIES, **router},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("retry_after", [None, "1"], ids=["no-retry-after", "retry-after-1"])
async def test_a_429_from_the_only_deployment_is_retried(
    fake_upstream: FakeUpstream, retry_after: str | None, stream: bool
) -> None:
    """After its Retry-After (when at most max_backoff_s), or the usual backoff when it sent none; the deployment
    that then answers is back for the next request too (no 503 upstream_cooling_down)."""
    fake_upstream.queue(Behavior(mode="status", status=429, retry_after=retry_after))
    async with asgi_client(build_app(only_deployment(fake_upstream))) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers=AUTH)
        assert response.status_code == 200, response.text
        assert len(fake_upstream.requests) == 2
        again = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert again.status_code == 200, again.text
    assert len(fake_upstream.requests) == 3


async def test_retries_spent_on_429s_give_the_upstreams_429_not_a_503(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="status", status=429, retry_after="1")
    async with asgi_client(build_app(only_deployment(fake_upstream, num_retries=1))) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "upstream_rate_limited"
    assert response.headers["retry-after"] == "1"
    assert len(fake_upstream.requests) == 2  # 1 + num_retries


async def test_a_retry_after_longer_than_a_retry_waits_goes_to_the_client(fake_upstream: FakeUpstream) -> None:
    """Retry-After 30 > max_backoff_s: no retry against the upstream's word; the client gets its 429 and Retry-After,
    and so does the next request while the deployment is out (429 with the time left, not 503)."""
    fake_upstream.behave(mode="status", status=429, retry_after="30")
    async with asgi_client(build_app(only_deployment(fake_upstream))) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert response.status_code == 429 and response.headers["retry-after"] == "30"
        again = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert again.status_code == 429, again.text
    assert again.json()["error"]["code"] == "upstream_rate_limited"
    assert 1 <= int(again.headers["retry-after"]) <= 30
    assert len(fake_upstream.requests) == 1  # the cooling deployment was not asked again
