"""The readiness rule docs/operations.md and docs/engine.md state: 200 when Redis can be written (if used) and a
deployment is `up` or none is configured; 503 when deployments are configured and none is `up`."""

from __future__ import annotations

import asyncio
from typing import Any

from fakes.app import asgi_client, build_app, deployment


async def test_a_gateway_without_deployments_is_ready() -> None:
    async with asgi_client(build_app({"models": []})) as client:
        ready = await client.get("/health/ready")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "redis": "not_used", "deployments": {}}


async def test_deployments_none_of_them_up_is_not_ready(fake_upstream_factory: Any) -> None:
    down = fake_upstream_factory()
    down.stop()
    app = build_app(
        {"models": [{"id": "gpt-test", "deployments": [deployment(down, name="down")]}]}, health_probe_interval_s=0.01
    )
    async with asgi_client(app) as client:
        async with asyncio.timeout(30):
            while app.state.health_prober.num_rounds < 1:  # the gateway's own probe schedule marks it down
                await asyncio.sleep(0.01)
        ready = await client.get("/health/ready")
    assert ready.status_code == 503
    assert ready.json() == {"status": "unavailable", "redis": "not_used", "deployments": {"down": "down"}}
