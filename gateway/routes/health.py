"""Liveness, readiness (Redis when the access object can `ping`, and every deployment's health probe), metrics."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.router import Deployment, Router
from gateway.routes.openai import JSONBytesResponse

__all__ = ["health_routes"]

_PROBE_TIMEOUT_S = 3.0


async def live(request: Request) -> Response:
    return JSONBytesResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 when Redis answers (if used) and at least one deployment is up (if any); 503 otherwise.
    A deployment whose probe fails is marked down (cooldown) so traffic avoids it."""
    router: Router = request.app.state.router
    ping = getattr(request.app.state.access, "ping", None)
    deployments = router.deployments
    results = await asyncio.gather(
        _probe_redis(ping),
        *(_probe(d) for d in deployments),
    )
    redis_state, deployment_ok = results[0], results[1:]
    states: dict[str, str] = {}
    for deployment, is_ok in zip(deployments, deployment_ok, strict=True):
        if not is_ok:
            router.mark_down(deployment)
            states[deployment.name] = "down"
        else:
            states[deployment.name] = "cooling_down" if router.is_cooling(deployment) else "up"
    is_ready = redis_state != "down" and (not deployments or any(s == "up" for s in states.values()))
    body = {"status": "ok" if is_ready else "unavailable", "redis": redis_state, "deployments": states}
    return JSONBytesResponse(body, status_code=200 if is_ready else 503)


async def _probe_redis(ping: object) -> str:
    if ping is None or not callable(ping):
        return "not_used"
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            if await ping():
                return "ok"
    return "down"


async def _probe(deployment: Deployment) -> bool:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_PROBE_TIMEOUT_S):
            return await deployment.backend.check_health()
    return False


async def metrics(request: Request) -> Response:
    registry: GatewayMetrics = request.app.state.metrics
    return Response(registry.render(), media_type=CONTENT_TYPE)


def health_routes() -> list[Route]:
    return [
        Route("/health/live", live, methods=["GET"]),
        Route("/health/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
