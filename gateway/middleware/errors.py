"""The one place errors become responses: any `GatewayError` in its route family's envelope (Anthropic shape
under /v1/messages, OpenAI shape elsewhere); any other exception → 500 `internal_error`, no traceback leaked.

A client that went away (Starlette's `ClientDisconnect` while its body was read, or `ClientDisconnectedError` while
the gateway waited for an upstream) is answered with nothing, since nobody would read it: one log line, the
`client_disconnected` error count, and status 499 in the request metrics (`state["client_disconnected"]`)."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ClientDisconnectedError, GatewayError, NotFoundError, render_anthropic, render_openai
from gateway.metrics import GatewayMetrics
from gateway.request_trace import RequestTrace
from gateway.security_headers import SECURITY_HEADERS
from gateway.translate.anthropic_meta import anthropic_headers

__all__ = ["ErrorMiddleware", "error_response", "http_exception_handler"]

logger = logging.getLogger("unigate.errors")


def error_response(scope: Scope, error: GatewayError) -> Response:
    """`error` rendered in the envelope of the route family `scope` belongs to; under `/ui` with the console's
    security headers (docs/console.md: every `/ui` response carries them, errors raised before or outside the
    console's handlers too: the body limit's 413, a 500, Starlette's 404/405)."""
    headers = dict(error.headers)
    path = scope.get("path", "")
    if path == "/ui" or path.startswith("/ui/"):
        headers = {**headers, **SECURITY_HEADERS}
        headers.setdefault("cache-control", "no-store")
    if path.startswith("/v1/messages"):
        body = render_anthropic(error)
        request_id = (scope.get("state") or {}).get("request_id")
        if request_id:
            headers = anthropic_headers(headers, request_id=request_id)
    else:
        body = render_openai(error)
    return Response(body, status_code=error.status_code, headers=headers, media_type="application/json")


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) / 405 (wrong method), in our envelope."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        error: GatewayError = NotFoundError(
            f"No route for {request.method} {request.url.path}. Check the base URL: it should end in /v1 "
            "(e.g. https://<gateway host>/v1) and the path should be an OpenAI endpoint such as /chat/completions.",
            code="not_found",
        )
    else:
        error = GatewayError(
            f"{request.method} is not allowed on {request.url.path} ({exc.detail}).",
            code="method_not_allowed",
            status_code=exc.status_code,
        )
        error.type = "invalid_request_error"
    return error_response(request.scope, error)


class ErrorMiddleware:
    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_started = False

        async def send_tracking(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except (ClientDisconnect, ClientDisconnectedError):
            self._client_gone(scope, is_started)
        except GatewayError as error:
            self.metrics.errors.labels(error.code).inc()
            if (trace := RequestTrace.of(scope.get("state"))) is not None:
                trace.failed(error.code)
            if is_started:
                logger.warning("error after the response started: %s (%s)", error.code, error.message)
                return
            await error_response(scope, error)(scope, receive, send)
        except Exception:
            logger.exception("unhandled error")
            self.metrics.errors.labels("internal_error").inc()
            if (trace := RequestTrace.of(scope.get("state"))) is not None:
                trace.failed("internal_error")
            if is_started:
                return
            request_id = (scope.get("state") or {}).get("request_id", "")
            internal = GatewayError(
                f"The gateway hit an unexpected error (request id {request_id}). Retry; if it persists, report it "
                "with the request id.",
                code="internal_error",
            )
            await error_response(scope, internal)(scope, receive, send)

    def _client_gone(self, scope: Scope, is_started: bool) -> None:
        self.metrics.errors.labels(ClientDisconnectedError.code).inc()
        scope.setdefault("state", {})["client_disconnected"] = True
        when = "after the response started" if is_started else "before the response"
        logger.info("client disconnected %s: %s %s", when, scope["method"], scope["path"])
