"""Readiness reports, it never decides (issue 25, item 9): an anonymous `GET /health/ready` sends nothing upstream
and changes no routing; health probes that take deployments out run on the gateway's own schedule and timeout."""

from __future__ import annotations

import asyncio
from typing import Any

from fakes.app import AUTH, CHAT, asgi_client, build_app, deployment
from fakes.upstream import FakeUpstream


def two_deployments(up: FakeUpstream, down: FakeUpstream) -> dict[str, Any]:
    return {"models": [{"id": "gpt-test", "deployments": [deployment(up, name="up"), deployment(down, name="down")]}]}


async def wait_for_rounds(app: Any, num_rounds: int) -> None:
    async with asyncio.timeout(30):
        while app.state.health_prober.num_rounds < num_rounds:
            await asyncio.sleep(0.01)


async def test_anonymous_readiness_never_probes_nor_changes_routing(fake_upstream_factory: Any) -> None:
    up, down = fake_upstream_factory(), fake_upstream_factory()
    down.stop()
    app = build_app(two_deployments(up, down), health_probe_interval_s=0)  # no scheduled probes at all
    async with asgi_client(app) as client:
        for _ in range(5):
            ready = await client.get("/health/ready")  # no credentials: anyone may call it
            assert ready.status_code == 200
            assert ready.json()["deployments"] == {"up": "up", "down": "up"}  # not known to be failing
        router = app.state.router
        assert not any(router.is_cooling(d) for d in router.deployments)
    assert up.requests == []  # readiness sent nothing upstream


async def test_probes_run_on_the_gateways_schedule(fake_upstream_factory: Any) -> None:
    up, down = fake_upstream_factory(), fake_upstream_factory()
    down.stop()
    app = build_app(two_deployments(up, down), health_probe_interval_s=0.01)
    async with asgi_client(app) as client:
        await wait_for_rounds(app, 2)
        assert (await client.get("/health/ready")).json()["deployments"] == {"up": "up", "down": "down"}
        router = app.state.router
        assert [router.is_cooling(d) for d in router.deployments] == [False, True]
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
    probes = [r for r in up.requests if r.method == "GET"]
    assert len(probes) >= 2 and {r.path for r in probes} == {"/v1/models"}


class HangingBackend:
    """A deployment whose health probe never answers (an upstream with a stuck `/models`)."""

    name = "stuck"

    def supports(self, endpoint: str) -> bool:
        return True

    async def check_health(self) -> bool:
        await asyncio.Event().wait()
        return True

    async def aclose(self) -> None:
        return None


async def test_a_probe_that_hangs_fails_after_its_timeout(fake_upstream_factory: Any) -> None:
    up, stuck = fake_upstream_factory(), fake_upstream_factory()
    routing = two_deployments(up, stuck)
    routing["models"][0]["deployments"][1]["name"] = "stuck"
    app = build_app(
        routing, backends={"stuck": HangingBackend()}, health_probe_interval_s=0.01, health_probe_timeout_s=0.05
    )
    async with asgi_client(app) as client:
        await wait_for_rounds(app, 1)
        ready = await client.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["deployments"] == {"up": "up", "stuck": "down"}


async def test_probing_stops_with_the_app(fake_upstream: FakeUpstream) -> None:
    app = build_app(
        {"models": [{"id": "gpt-test", "deployments": [deployment(fake_upstream)]}]}, health_probe_interval_s=0.01
    )
    async with asgi_client(app):
        await wait_for_rounds(app, 1)
    num_rounds = app.state.health_prober.num_rounds
    await asyncio.sleep(0.05)  # (no timing assertion: only that no round runs after shutdown)
    assert app.state.health_prober.num_rounds == num_rounds
