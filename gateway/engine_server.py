"""`unigate engine serve`: the local engine alone behind an OpenAI-compatible server.

The same process serves two topologies (docs/operations.md#one-engine-per-host):

- alone, e.g. on a GPU host: gateways on other hosts route to its `/v1` as a `type: openai` upstream;
- started by `unigate serve --workers N` (`gateway.engine_process`) on a Unix socket, once per local deployment:
  every worker reaches it through `backends.engine_client.EngineClient`, over the engine protocol below.

It is the gateway app with one model, the local engine, and no Redis: keys and limits belong to the gateway in
front. With `api_key` set, callers must send it; without, any or no key.

The engine protocol (not a public API) hands the local backend's own calls across the process boundary, answered
by the backend itself with no pipeline in between (the worker's pipeline has done auth, limits and routing):

    POST /engine/send/{endpoint}     the backend's JSON response
    POST /engine/stream/{endpoint}   its chunks as SSE `data:` events, then `data: [DONE]`; closing the connection
                                     aborts the request (its KV blocks are freed within a step)
    POST /engine/count_tokens        {"num_tokens": n} for a chat-completions body
    GET  /engine/state               {"pid", "state", "context_length", "stats"}

A failure is the gateway error the backend raised, as `error_payload` writes it: the response's body (with the
error's status and headers) before a stream starts, a `data:` event in the middle of one.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from auth.base import MasterKeyAccess, Principal
from gateway.app import create_app
from gateway.disconnect import unless_disconnected, watch_disconnect
from gateway.errors import AuthError, ClientDisconnectedError, GatewayError, InvalidRequestError, NotFoundError
from gateway.http_limits import protocol_options
from gateway.logging import request_id_var
from gateway.routes.openai import JSONBytesResponse
from gateway.routing_config import DeploymentConfig, default_routing, parse_routing
from gateway.settings import Settings
from gateway.sse import DONE, EventStreamResponse, encode_data

if TYPE_CHECKING:
    from backends.local import LocalBackend

__all__ = ["create_engine_app", "error_payload", "serve_engine"]

logger = logging.getLogger("unigate.engine")

_OPEN_KEY = "sk-ug-engine-open"
_ENDPOINTS = frozenset({"chat/completions", "completions"})


class _DefaultKeyMiddleware:
    """Adds `authorization: Bearer <the open key>` to requests that carry no key, so an unprotected engine
    accepts callers (e.g. a gateway upstream entry without `api_key`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = list(scope["headers"])
            if not any(name in (b"authorization", b"x-api-key") for name, _ in headers):
                scope = {**scope, "headers": [*headers, (b"authorization", f"Bearer {_OPEN_KEY}".encode())]}
        await self.app(scope, receive, send)


class _AnyKeyAccess(MasterKeyAccess):
    """Every key is valid (an unprotected engine server)."""

    async def authenticate(self, credential: str) -> Principal:
        return await super().authenticate(_OPEN_KEY)


def create_engine_app(
    settings: Settings, *, api_key: str | None = None, deployment: DeploymentConfig | None = None
) -> ASGIApp:
    """The engine server app: `deployment` (a `type: local` routing entry, served under its own model id and
    name) as its only model, else the model of `settings.engine`."""
    engine_settings = settings.engine.model_copy(update={"enabled": True})
    settings = settings.model_copy(update={"engine": engine_settings}).with_engine_sockets({})
    if deployment is None:
        routing = default_routing(settings)
    else:
        entry = deployment.model_dump(mode="json", exclude={"id"})
        routing = parse_routing({"models": [{"id": deployment.id, "deployments": [entry]}]}, source="<engine>")
    access = MasterKeyAccess(api_key) if api_key else _AnyKeyAccess(_OPEN_KEY)
    app = _EngineProtocol(create_app(settings, access=access, routing=routing), api_key=api_key)
    return app if api_key else _DefaultKeyMiddleware(app)


def serve_engine(
    settings: Settings,
    *,
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    deployment: DeploymentConfig | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Run the engine server until SIGTERM / SIGINT: on `host:port`, or on `sock` (a bound socket, e.g. the Unix
    socket `gateway.engine_process` made); `on_started` runs once it accepts requests."""
    config = uvicorn.Config(
        create_engine_app(settings, api_key=api_key, deployment=deployment),
        host=host,
        port=port,
        log_config=None,  # configure_logging owns the handlers
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        **protocol_options(settings.max_header_bytes),
    )
    _Server(config, on_started).run(sockets=[sock] if sock is not None else None)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_started is not None:
            self._on_started()


# -- the engine protocol --------------------------------------------------------------------------------------------


def error_payload(error: GatewayError) -> dict[str, Any]:
    """An error as the engine protocol carries it: the OpenAI envelope plus the status and headers to answer with."""
    return {**error.to_dict(), "status": error.status_code, "headers": error.headers}


class _EngineProtocol:
    """Serves `/engine/...` (the engine protocol) beside the gateway app, outside its middleware: a worker already
    did what that middleware does, and the engine process spends its CPU on the engine."""

    def __init__(self, app: Starlette, *, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key
        routes = [
            Route("/engine/send/{endpoint:path}", self._guard(self.send), methods=["POST"]),
            Route("/engine/stream/{endpoint:path}", self._guard(self.stream), methods=["POST"]),
            Route("/engine/count_tokens", self._guard(self.count_tokens), methods=["POST"]),
            Route("/engine/state", self._guard(self.state), methods=["GET"]),
        ]
        self.protocol = Starlette(routes=routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/engine/"):
            await self.protocol(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _guard(self, handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            if self.api_key is not None and not _has_key(request, self.api_key):
                return _error_response(AuthError("The engine protocol needs the engine server's key."))
            request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
            token = request_id_var.set(request_id)
            try:
                return await handler(request)
            except GatewayError as error:
                if isinstance(error, ClientDisconnectedError):
                    logger.info("client disconnected before the response: %s %s", request.method, request.url.path)
                return _error_response(error)
            finally:
                request_id_var.reset(token)

        return guarded

    def _backend(self) -> LocalBackend:
        [deployment] = self.app.state.router.deployments  # built by the gateway app's lifespan
        return cast("LocalBackend", deployment.backend)

    async def send(self, request: Request) -> Response:
        endpoint, body = _endpoint(request), await _body(request)
        request_id = request_id_var.get() or ""
        with watch_disconnect(request.receive):
            data = await unless_disconnected(self._backend().send(endpoint, body, request_id=request_id))
        return JSONBytesResponse(data)

    async def stream(self, request: Request) -> Response:
        endpoint, body = _endpoint(request), await _body(request)
        request_id = request_id_var.get() or ""
        chunks = cast(
            AsyncGenerator[dict[str, Any], None], self._backend().stream(endpoint, body, request_id=request_id)
        )
        with watch_disconnect(request.receive):  # a caller gone before the first chunk aborts the request too
            try:
                first = await unless_disconnected(anext(chunks))
            except StopAsyncIteration:
                first = None
            except BaseException:
                await chunks.aclose()
                raise
        return EventStreamResponse(_events(first, chunks), error_tail=_error_tail)

    async def count_tokens(self, request: Request) -> Response:
        return JSONBytesResponse({"num_tokens": await self._backend().count_prompt_tokens(await _body(request))})

    async def state(self, request: Request) -> Response:
        backend = self._backend()
        state = {
            "pid": os.getpid(),
            "state": backend.health_state(),
            "context_length": backend.output_limits().context_length,
            "stats": backend.stats(),
        }
        return JSONBytesResponse(state)


def _has_key(request: Request, api_key: str) -> bool:
    credential = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
    return hmac.compare_digest(credential.encode(), api_key.encode())


def _endpoint(request: Request) -> Any:
    endpoint = request.path_params["endpoint"]
    if endpoint not in _ENDPOINTS:
        raise NotFoundError(f"The engine serves no /{endpoint}.", code="not_found")
    return endpoint


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except ClientDisconnect:
        raise ClientDisconnectedError("The worker closed the connection while sending the body.") from None
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"The body is not JSON ({exc.msg}).", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_json")
    return body


class _Unsent(Response):
    """The answer to a caller that went away: nothing is sent on the gone connection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


def _error_response(error: GatewayError) -> Response:
    if isinstance(error, ClientDisconnectedError):
        return _Unsent(status_code=error.status_code)
    return JSONBytesResponse(error_payload(error), status_code=error.status_code, headers=error.headers)


def _error_tail(error: GatewayError) -> bytes:
    return encode_data(error_payload(error)) + DONE


async def _events(first: dict[str, Any] | None, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield encode_data(first)
            async for chunk in chunks:
                yield encode_data(chunk)
        yield DONE
    finally:
        await chunks.aclose()  # the caller went away: the engine aborts the request
