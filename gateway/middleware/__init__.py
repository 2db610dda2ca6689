"""Plain ASGI middleware, one per module; `build_middleware` is the one place their order is decided."""

from __future__ import annotations

from starlette.middleware import Middleware

from auth.request_log import RequestLog
from gateway.metrics import GatewayMetrics
from gateway.middleware.body_limit import BodyLimitMiddleware
from gateway.middleware.errors import ErrorMiddleware, error_response, http_exception_handler
from gateway.middleware.metrics import MetricsMiddleware
from gateway.middleware.metrics_access import MetricsAccessMiddleware
from gateway.middleware.path_normalize import PathNormalizeMiddleware, normalize_path
from gateway.middleware.request_id import RequestIdMiddleware
from gateway.middleware.request_trace import RequestTraceMiddleware
from gateway.settings import Settings
from gateway.tracing import Tracing

__all__ = [
    "BodyLimitMiddleware",
    "ErrorMiddleware",
    "MetricsAccessMiddleware",
    "MetricsMiddleware",
    "PathNormalizeMiddleware",
    "RequestIdMiddleware",
    "RequestTraceMiddleware",
    "build_middleware",
    "error_response",
    "http_exception_handler",
    "normalize_path",
]


def build_middleware(
    settings: Settings,
    metrics: GatewayMetrics,
    *,
    request_log: RequestLog | None = None,
    tracing: Tracing | None = None,
) -> list[Middleware]:
    """Outermost first."""
    metrics_token = settings.metrics_token.get_secret_value() if settings.metrics_token is not None else None
    return [
        # 1. Every response, even a 500, carries the request id; it is also in every log line.
        Middleware(RequestIdMiddleware),
        # 2. Rewrite the path before anything looks at it, so metrics and errors see the served route.
        Middleware(PathNormalizeMiddleware),
        # 3. The request's trace: begun on arrival (its root span continues a client's traceparent), finished into
        #    the request log and the spans once the response ended (model routes only; omitted when both are off).
        *(
            [Middleware(RequestTraceMiddleware, log=request_log, tracing=tracing)]
            if request_log is not None or tracing is not None
            else []
        ),
        # 4. Metrics see the final status, including rendered errors.
        Middleware(MetricsMiddleware, metrics=metrics),
        # 5. Every error below becomes one envelope.
        Middleware(ErrorMiddleware, metrics=metrics),
        # 6. /metrics wants its token / network when configured (a GatewayError, rendered by 5).
        Middleware(MetricsAccessMiddleware, token=metrics_token, networks=settings.metrics_allow),
        # 7. Oversized bodies fail while being read (a GatewayError, rendered by 5).
        Middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes),
    ]
