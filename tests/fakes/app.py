"""Build a gateway app for some fake upstreams and talk to it in-process (lifespan running)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette

from fakes.access import RecordingAccess
from fakes.upstream import FakeUpstream
from gateway.app import create_app
from gateway.routing_config import parse_routing
from gateway.settings import Settings

MASTER = "sk-ug-master-test-key-0123456789"  # 32 characters: `serve` refuses shorter ones
AUTH = {"authorization": f"Bearer {MASTER}"}
CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "Hello there"}]}


def deployment(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return {"type": "openai", "base_url": upstream.base_url, "api_key": "sk-upstream-SECRET-123", **extra}


def make_settings(**overrides: Any) -> Settings:
    """Settings for an in-test gateway: no scheduled health probes unless a test asks (they would add requests to
    the fakes' exact traffic logs of longer tests)."""
    values: dict[str, Any] = {"engine": {"enabled": False}, "health_probe_interval_s": 0, **overrides}
    return Settings(_env_file=None, master_key=MASTER, **values)  # type: ignore[arg-type]


def build_app(
    routing: dict[str, Any], *, access: RecordingAccess | None = None, backends: Any = None, **settings: Any
) -> Starlette:
    access = access or RecordingAccess(master_key=MASTER)
    return create_app(
        make_settings(**settings),
        access=access,
        upstream_limiter=access,
        routing=parse_routing(routing, source="test.yaml"),
        backends=backends,
    )


def single_model(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    router = extra.pop("router", {"retry_backoff_s": 0.001, "max_backoff_s": 0.01})
    return {
        "models": [{"id": "gpt-test", "aliases": ["fast"], "deployments": [deployment(upstream, **extra)]}],
        "router": router,
    }


@asynccontextmanager
async def asgi_client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """In-process client with the app's lifespan running (non-streaming tests)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            yield client
