"""The `UNIGATE_REDIS_URL` forms and the client's fail-fast timeouts (the topologies for real: test_sentinel.py,
test_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from auth.embedded_redis import RedisConnection
from auth.redis_client import RedisTarget, parse_redis_url
from gateway.settings import Settings


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:1/2", RedisTarget("standalone", url="redis://h:1/2")),
        ("unix:///tmp/r.sock", RedisTarget("standalone", url="unix:///tmp/r.sock")),
        (
            "redis+sentinel://s1:26379,s2:26380/mymaster/3",
            RedisTarget("sentinel", nodes=(("s1", 26379), ("s2", 26380)), service="mymaster", db=3),
        ),
        (
            "rediss+sentinel://u:p%40ss@s1:1/svc",
            RedisTarget("sentinel", nodes=(("s1", 1),), service="svc", username="u", password="p@ss", is_tls=True),
        ),
        (
            "redis+cluster://:secret@n1:7000,n2:7001/0",
            RedisTarget("cluster", nodes=(("n1", 7000), ("n2", 7001)), password="secret"),
        ),
        ("redis+cluster://[::1]:7000", RedisTarget("cluster", nodes=(("::1", 7000),))),
    ],
)
def test_url_forms(url: str, expected: RedisTarget) -> None:
    assert parse_redis_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://s1:26379", "no service name"),
        ("redis+sentinel://s1:26379/svc/x", "/service/db"),
        ("redis+cluster://n1:7000/1", "only database 0"),
        ("redis+cluster://n1/0", "'n1' is not host:port"),
        ("redis+swarm://n1:1", "unknown scheme"),
        ("localhost:6379", "no scheme"),
    ],
)
def test_bad_urls_say_what_is_expected(url: str, message: str) -> None:
    with pytest.raises(ValueError, match="redis\\+sentinel://host:port") as caught:
        parse_redis_url(url)
    assert message in str(caught.value)


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
