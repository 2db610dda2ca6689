"""Fixtures for the access-control tests: a flushed real Redis, the store, access instances, an admin app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from auth.access import AccessConfig, RedisAccess
from auth.redis_client import connect
from auth.store import KeyStore
from gateway.errors import GatewayError, render_openai
from gateway.routes.admin import admin_routes
from gateway.settings import LimitSettings, Settings

MASTER_KEY = "sk-ug-master-test-key-0123456789"


def make_settings(data_dir: Path, **limits: Any) -> Settings:
    mode = limits.pop("redis_failure_mode", "closed")
    return Settings(
        _env_file=None,  # type: ignore[call-arg]
        data_dir=data_dir,
        master_key=MASTER_KEY,  # type: ignore[arg-type]
        redis_failure_mode=mode,
        limits=LimitSettings(**limits),
    )


async def _render(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return Response(render_openai(exc), status_code=exc.status_code, headers=exc.headers, media_type="application/json")


def make_admin_app(store: KeyStore, settings: Settings) -> Starlette:
    app = Starlette(routes=admin_routes(), exception_handlers={GatewayError: _render})
    app.state.key_store = store
    app.state.settings = settings
    return app


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def store(redis: Redis) -> KeyStore:
    return KeyStore(redis)


@pytest.fixture
async def make_access(redis_url: str, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[RedisAccess]]]:
    """Build started `RedisAccess` instances (each with its own Redis client, like separate gateway instances)."""
    created: list[tuple[RedisAccess, Redis]] = []

    async def build(url: str | None = None, *, rate_window_s: float = 60.0, **limits: Any) -> RedisAccess:
        client = connect(url or redis_url)
        config = AccessConfig(failure_mode=limits.pop("redis_failure_mode", "closed"), **limits)
        access = RedisAccess(client, config=config, master_key=MASTER_KEY, rate_window_s=rate_window_s)
        await access.start()
        created.append((access, client))
        return access

    yield build
    for access, client in created:
        await access.aclose()
        await client.aclose()


@pytest.fixture
async def admin(store: KeyStore, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the admin routes, authenticated with the master key."""
    transport = httpx.ASGITransport(app=make_admin_app(store, settings))
    headers = {"authorization": f"Bearer {MASTER_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as client:
        yield client


@pytest.fixture
def new_key(store: KeyStore) -> Callable[..., Awaitable[tuple[str, str]]]:
    """Create a key straight in the store: returns (id, secret)."""

    async def create(**fields: Any) -> tuple[str, str]:
        record, secret = await store.create(fields)
        return record.id, secret

    return create
