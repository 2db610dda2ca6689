"""`unigate engine serve`: the local engine alone behind an OpenAI-compatible HTTP server, for gateways on other
hosts, which route to its `/v1` as a `type: openai` upstream (docs/operations.md#one-engine-per-host).

It is the gateway app (`create_app`) with one model, the local engine, and no Redis: keys and limits belong to the
gateway in front. That app is its public behaviour (chat and text completions, Messages, Responses, count_tokens,
/v1/models, health and metrics, the error envelopes), which a smaller app would have to copy. With `api_key` set,
callers must send it; without, any or no key. The engine process of `unigate serve --workers N` is a different
server: `gateway.engine_host.main`, with no web app.
"""

from __future__ import annotations

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from auth.base import MasterKeyAccess, Principal
from gateway.app import create_app
from gateway.http_limits import protocol_options
from gateway.routing_config import default_routing
from gateway.settings import Settings

__all__ = ["create_engine_app", "serve_engine"]

_OPEN_KEY = "sk-ug-engine-open"


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


def create_engine_app(settings: Settings, *, api_key: str | None = None) -> ASGIApp:
    """The engine server app: the model of `settings.engine` as its only model."""
    engine_settings = settings.engine.model_copy(update={"enabled": True})
    settings = settings.model_copy(update={"engine": engine_settings}).with_engine_sockets({})
    access = MasterKeyAccess(api_key) if api_key else _AnyKeyAccess(_OPEN_KEY)
    app = create_app(settings, access=access, routing=default_routing(settings))
    return app if api_key else _DefaultKeyMiddleware(app)


def serve_engine(settings: Settings, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the engine server on `host:port` until SIGTERM / SIGINT."""
    config = uvicorn.Config(
        create_engine_app(settings, api_key=api_key),
        host=host,
        port=port,
        log_config=None,  # configure_logging owns the handlers
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
        **protocol_options(settings.max_header_bytes),
    )
    uvicorn.Server(config).run()
