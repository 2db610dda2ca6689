"""Liveness, readiness (Redis when the access object can `ping`: can it be written, not just reached; and each
deployment's last known state), metrics.

Readiness only reports: deployment states come from the gateway's own `HealthProber` schedule, so an anonymous
`GET /health/ready` never probes an upstream and never changes routing.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.health_probe import HealthProber
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.routes.openai import JSONBytesResponse
from gateway.settings import Settings

__all__ = ["health_routes"]


async def live(request: Request) -> Response:
    return JSONBytesResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when Redis can be written (if used) and at least one deployment is `up`, or none is configured; 503
    otherwise. Deployments are `up`, `down`, `cooling_down`, `loading`, `restarting` or `load_failed`; when one is
    `load_failed`, `reasons` maps it to its error code (see `gateway.health_probe`)."""
    prober: HealthProber = request.app.state.health_prober
    settings: Settings = request.app.state.settings
    redis_state = await _probe_redis(getattr(request.app.state.access, "ping", None), settings.health_probe_timeout_s)
    states = prober.states()
    is_ready = redis_state != "down" and (not states or any(s == "up" for s in states.values()))
    body: dict[str, object] = {
        "status": "ok" if is_ready else "unavailable",
        "redis": redis_state,
        "deployments": states,
    }
    reasons = prober.reasons()
    if reasons:  # only when some deployment is `load_failed`: the body is otherwise as it always was
        body["reasons"] = reasons
    return JSONBytesResponse(body, status_code=200 if is_ready else 503)


async def _probe_redis(ping: object, timeout_s: float) -> str:
    """Whether Redis takes writes, asked live (a read-only replica, a cluster that is down or a failover in
    progress say "down"): it decides nothing about routing."""
    if ping is None or not callable(ping):
        return "not_used"
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            if await ping():
                return "ok"
    return "down"


async def metrics(request: Request) -> Response:
    registry: GatewayMetrics = request.app.state.metrics
    return Response(registry.render(), media_type=CONTENT_TYPE)


def health_routes() -> list[Route]:
    return [
        Route("/health/live", live, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
