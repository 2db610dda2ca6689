"""The embedded redis-server's persistence settings and the client's fail-fast timeouts, on real servers."""

from __future__ import annotations

from pathlib import Path

import redis as sync_redis

from auth.redis_client import EmbeddedRedis, RedisConnection
from gateway.settings import Settings


def test_the_embedded_server_snapshots_and_appends(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    client = sync_redis.Redis.from_url(server.start())
    try:
        assert client.config_get("save") == {"save": "60 1"}  # RDB: a snapshot a minute after any write
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("k", "v")
    finally:
        client.close()
        server.stop()  # SIGTERM: with snapshots on, Redis writes the RDB file as it exits
    assert (tmp_path / "redis" / "redis.rdb").is_file()


async def test_the_client_gives_up_on_redis_after_one_second_by_default(tmp_path: Path) -> None:
    settings = Settings(_env_file=None)
    connection = RedisConnection(None, tmp_path / "redis", timeout_s=settings.limits.redis_timeout_s)
    client = connection.start()
    try:
        options = client.connection_pool.connection_kwargs
        assert options["socket_timeout"] == options["socket_connect_timeout"] == 1.0
        assert await client.ping()
    finally:
        await connection.stop()
