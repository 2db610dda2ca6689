"""Redis Sentinel for real (a primary, a replica and a Sentinel from the bundled redis-server) and /health/ready's
write probe against a read-only replica (the URL forms: test_redis_client.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.instances import gateway_instances
from fakes.redis_topologies import LocalSentinel, RedisProcess, wait_until

from auth.redis_client import connect, is_writable
from auth.store import KeyStore
from gateway.errors import UnavailableError


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[LocalSentinel]:
    local = LocalSentinel(tmp_path / "sentinel")
    local.start()
    yield local
    local.stop()


async def test_the_client_follows_a_failover_and_loses_no_acknowledged_write(sentinel: LocalSentinel) -> None:
    client = connect(sentinel.url)
    loop = asyncio.get_running_loop()
    num_ok = num_failed = 0
    try:
        await client.set("n", 0)
        failover = loop.run_in_executor(None, sentinel.failover)
        deadline = time.monotonic() + 20
        while not failover.done() or num_ok < 200:  # writes all along, then 200 more on the new primary
            assert time.monotonic() < deadline
            try:
                await client.incr("n")
                num_ok += 1
            except Exception:
                num_failed += 1
                await asyncio.sleep(0.01)
        new_primary = await failover
        assert await is_writable(client)
    finally:
        await client.aclose()
    # Every INCR the client saw succeed is on the new primary (one more if a reply was lost with its connection).
    assert num_ok <= int(new_primary.command("GET", "n")) <= num_ok + num_failed


async def test_the_write_probe_says_no_on_a_read_only_replica(sentinel: LocalSentinel) -> None:
    on_replica = connect(f"redis://{sentinel.replica.address}/0")
    on_primary = connect(f"redis://{sentinel.primary.address}/0")
    through_sentinel = connect(sentinel.url)
    try:
        assert await on_replica.ping()  # it answers...
        assert not await is_writable(on_replica)  # ...but cannot be written
        assert await is_writable(on_primary)
        assert await is_writable(through_sentinel)
    finally:
        for client in (on_replica, on_primary, through_sentinel):
            await client.aclose()


async def test_ready_is_503_on_a_read_only_replica_and_recovers_by_itself(
    sentinel: LocalSentinel, tmp_path: Path
) -> None:
    replica = sentinel.replica
    with gateway_instances(f"redis://{replica.address}/0", tmp_path, [], names=("a",)) as (gateway,):
        async with httpx.AsyncClient() as client:
            response = await client.get(f"{gateway.url}/health/ready")
            assert response.status_code == 503 and response.json()["redis"] == "down", response.text
            replica.command("REPLICAOF", "NO", "ONE")  # what a failover does to it
            deadline = time.monotonic() + 5
            while (response := await client.get(f"{gateway.url}/health/ready")).status_code != 200:
                assert time.monotonic() < deadline, response.text
                await asyncio.sleep(0.05)
            assert response.json()["redis"] == "ok"


@pytest.mark.parametrize("failure_mode", ["closed", "open"])
async def test_a_demoted_primary_is_never_taken_for_an_outage(
    tmp_path: Path, make_access: Any, failure_mode: str
) -> None:
    """A gateway whose plain redis:// URL names a primary that a failover demoted: READONLY answers 503 for every
    key, cached or not, in both failure modes — never an admission without limits — and /health says so."""
    old, new = RedisProcess(tmp_path / "old").start(), RedisProcess(tmp_path / "new")
    try:
        new.args += ["--replicaof", "127.0.0.1", str(old.port)]
        new.start()
        admin = connect(f"redis://{old.address}/0")
        _, secret = await KeyStore(admin).create({"rpm": 100})
        await admin.aclose()
        access = await make_access(f"redis://{old.address}/0", redis_failure_mode=failure_mode, key_cache_ttl_s=60)
        await access.admit(secret, model="m", estimated_tokens=1)  # cached and fresh
        assert await access.ping()
        wait_until(lambda: int(old.command("WAIT", 1, 1000)) == 1, timeout_s=5, what="the replica's sync")
        new.command("REPLICAOF", "NO", "ONE")  # the failover, as Sentinel does it
        old.command("REPLICAOF", "127.0.0.1", new.port)

        for _ in range(3):  # the first answer, then the fast-fail window after it
            with pytest.raises(UnavailableError) as caught:
                await access.admit(secret, model="m", estimated_tokens=1)
            assert caught.value.code == "limits_unavailable"
        assert access.num_limit_bypasses == 0
        assert not await access.ping()  # /health/ready: 503
    finally:
        old.stop()
        new.stop()
