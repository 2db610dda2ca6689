"""`unigate engine serve`: the local engine alone behind an OpenAI-compatible server.

Multi-worker gateways route to it as a `type: openai` upstream (one engine process owns the model and its KV
cache; gateway workers stay light). It is the gateway app with one model, the local engine, and no Redis: keys
and limits belong to the gateway in front. With `api_key` set, callers must send it; without, any or no key.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from auth.base import MasterKeyAccess, Principal
from gateway.app import create_app
from gateway.routing_config import default_routing
from gateway.settings import Settings

__all__ = ["create_engine_app"]

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
    """The engine server app: the model from `settings.engine` as its only model."""
    engine_settings = settings.engine.model_copy(update={"enabled": True})
    settings = settings.model_copy(update={"engine": engine_settings})
    access = MasterKeyAccess(api_key) if api_key else _AnyKeyAccess(_OPEN_KEY)
    app: Starlette = create_app(settings, access=access, routing=default_routing(settings))
    return app if api_key else _DefaultKeyMiddleware(app)
