"""Every request's trace (gateway/request_trace.py): begun on arrival, finished when its response has ended, then
one request-log record (for requests that got past authentication) and, with tracing on, its spans exported.

What only the end knows comes from here: the status the client got (499 when it left first), the error code the
envelope carried (noted in the trace by the error middleware, and by the pipeline for an error after a stream
started), and the time end to
end. Adding the record never waits: the log writes in batches off the hot path (auth/request_log.py). Requests
without a verified key (401s) have no record: nothing would say whose they were, and a flood of them must not
fill the log.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from auth.request_log import RequestLog
from gateway.errors import ClientDisconnectedError
from gateway.request_trace import RequestTrace
from gateway.tracing import Tracing

__all__ = ["RequestTraceMiddleware"]


class RequestTraceMiddleware:
    def __init__(self, app: ASGIApp, *, log: RequestLog | None, tracing: Tracing | None) -> None:
        self.app = app
        self.log = log
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)  # health checks, metrics, admin, console: not model requests
            return
        trace = RequestTrace.begin(scope, self.tracing)
        try:
            await self.app(scope, receive, send)
        finally:
            state = scope.get("state") or {}
            client_left = bool(state.get("client_disconnected"))
            # The status the metrics middleware (inside this one) saw the client get, 499 when it left first.
            status = state.get("status") or (ClientDisconnectedError.status_code if client_left else 500)
            row = trace.finish(
                request_id=str(state.get("request_id", "")),
                route=scope["path"],
                status=status,
                client_left=client_left,
            )
            if row is not None and self.log is not None:
                self.log.add_row(row)
