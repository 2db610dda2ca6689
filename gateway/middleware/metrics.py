"""Request count / latency / in-flight by model, route template and status, plus one log line per request.

On its first request it gives the metrics the app's configured model ids (`app.state.routing`), unless the app
did when it built them, so `model` labels stay within the routing table (gateway/metrics.py)."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ClientDisconnectedError
from gateway.metrics import GatewayMetrics

__all__ = ["MetricsMiddleware"]

logger = logging.getLogger("unigate.access")


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.metrics.has_models:
            self._bind_models(scope)
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        state["started_at"] = started
        status = 0  # until a response starts

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.in_flight.dec()
            if not status:  # no response: the client left (499, as nginx counts it), else the app failed
                status = ClientDisconnectedError.status_code if state.get("client_disconnected") else 500
            state["status"] = status  # the request's trace reads it (gateway/middleware/request_trace.py)
            elapsed = time.perf_counter() - started
            route = scope.get("route")
            # The route template, never the raw path: unknown paths must not create unbounded label values.
            template = getattr(route, "path", "other")
            model = state.get("model", "")
            self.metrics.observe_request(model, template, str(status), elapsed)
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "%s %s %d %.1fms",
                    scope["method"],
                    scope["path"],
                    status,
                    elapsed * 1000,
                    extra={"status": status, "duration_ms": round(elapsed * 1000, 2), "model": model or None},
                )

    def _bind_models(self, scope: Scope) -> None:
        routing = getattr(getattr(scope.get("app"), "state", None), "routing", None)
        models = getattr(routing, "models", None) or ()
        self.metrics.bind_models(model.id for model in models)
