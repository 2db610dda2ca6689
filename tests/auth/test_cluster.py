"""Redis Cluster for real: a 3-master cluster of bundled redis-servers on loopback.

Keys are created, listed, rotated and used on every shard (a MULTI over three slots used to make every key creation
a 503); the hot path follows MOVED and ASK while a key's slot is migrated under it, with its limits exact; and
/health/ready's write probe says no while a shard has no primary, and yes again when it is back.

The whole key/limit suite also runs on a cluster: `UNIGATE_TEST_REDIS_TOPOLOGY=cluster pytest tests/auth ...`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.redis_topologies import LocalCluster, RedisProcess, wait_until
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    ClusterDownError,
    ConnectionError,
    MovedError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from auth import redis_names, scripts
from auth.base import SettleUsage
from auth.cluster_pipe import ClusterCommandPipe
from auth.redis_client import RedisClient, connect, is_writable
from auth.scripts import DEFAULT_SCRIPTS, ScriptError, StorageError
from auth.store import KeyStore


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path / "cluster")
    local.start()
    yield local
    local.stop()


@pytest.fixture
async def client(cluster: LocalCluster) -> AsyncIterator[RedisClient]:
    redis = connect(cluster.url)
    yield redis
    await redis.aclose()


def _slot_of(key_id: str) -> int:
    return key_slot(redis_names.key_record(key_id).encode())


async def test_keys_live_on_every_shard_and_the_admin_operations_work(
    cluster: LocalCluster, client: RedisClient
) -> None:
    store = KeyStore(client)
    created = [await store.create({"name": f"k{i}", "rpm": 10}) for i in range(12)]
    owners = {cluster.master_of_slot(_slot_of(record.id)).port for record, _ in created}
    assert len(owners) >= 2, "12 random key ids should span several shards"

    page = await store.list_keys(limit=100)
    assert [r.id for r in page.records] == [r.id for r, _ in created]
    record, secret = created[0]
    assert (await store.find_by_secret(secret)) == record
    rotated, new_secret = await store.rotate(record.id)
    assert await store.find_by_secret(secret) is None
    assert (await store.find_by_secret(new_secret)).id == record.id  # type: ignore[union-attr]
    revoked = await store.revoke(created[1][0].id)
    assert revoked.is_revoked and rotated.version > record.version
    totals = await store.totals()
    assert totals.num_keys == 12 and totals.num_active_keys == 11


async def test_usage_of_keys_on_every_shard_is_read_in_one_pipeline(
    cluster: LocalCluster, client: RedisClient, make_access: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KeyStore.usage_many` (the console's usage rows): a pipeline whose commands' keys live on different shards,
    split over several round trips, returns what `usage` reads key by key."""
    import auth.store

    monkeypatch.setattr(auth.store, "_PIPELINE_BATCH", 4)
    store = KeyStore(client)
    access = await make_access(cluster.url)
    created = [await store.create({"name": f"u{i}"}) for i in range(8)]
    for i, (_, secret) in enumerate(created):
        for j in range(i % 3):
            admission = await access.admit(secret, model=f"m{j}", estimated_tokens=5)
            await access.settle(admission, SettleUsage(2, i))
    ids = [record.id for record, _ in created]
    assert len({cluster.master_of_slot(key_slot(redis_names.key_usage_days(i).encode())).port for i in ids}) >= 2
    many = await store.usage_many([*ids, redis_names.MASTER_ID], num_days=7)
    for key_id in ids:
        assert many[key_id] == await store.usage(key_id, num_days=7)
    assert sum(len(rows) for rows in many.values()) == sum(i % 3 for i in range(8))


async def _admit(pipe: ClusterCommandPipe, key_id: str, secret_hash: str, n: int) -> str:
    reply = await scripts.admit_request(
        pipe,
        scripts.AdmitArgs(
            state_id=key_id,
            key_hash=secret_hash,
            model="m",
            estimated_tokens=1,
            request_id=f"r{n}",
            lease_ttl_ms=60_000,
            window_ms=60_000,
            cached_version=None,
        ),
    )
    return reply.status


def _migrate(cluster: LocalCluster, slot: int, source: RedisProcess, target: RedisProcess, *, finish: bool) -> None:
    """Move `slot` from `source` to `target` as redis-cli --cluster reshard does: mark it, move its keys, and (with
    `finish`) tell every master the new owner. Unfinished, the source answers ASK for the keys it no longer has."""
    source_id, target_id = source.command("CLUSTER", "MYID"), target.command("CLUSTER", "MYID")
    target.command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    source.command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    keys = source.command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        source.command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    if finish:
        _finish(cluster, slot, target)


def _finish(cluster: LocalCluster, slot: int, target: RedisProcess) -> None:
    target_id = target.command("CLUSTER", "MYID")
    for node in cluster.nodes:
        node.command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    cluster.wait_ok()


async def test_the_hot_path_follows_ask_and_moved_while_a_slot_migrates(
    cluster: LocalCluster, client: RedisClient
) -> None:
    assert isinstance(client, RedisCluster)
    store = KeyStore(client)
    record, _ = await store.create({"rpm": 6})
    pipe = ClusterCommandPipe(client)
    try:
        statuses = [await _admit(pipe, record.id, record.key_hash, n) for n in range(2)]
        slot = _slot_of(record.id)
        source = cluster.master_of_slot(slot)
        target = next(node for node in cluster.nodes if node is not source)

        _migrate(cluster, slot, source, target, finish=False)  # keys moved, slot still the source's
        # A one-key script: the source answers ASK (it no longer has the key), the target takes it after ASKING.
        assert await scripts.update_key(pipe, key_id=record.id, fields={"name": "moved"})  # type: ignore[arg-type]
        asked = pipe.num_redirects
        assert asked >= 1
        # The admission's keys are split (its TPM and lease keys do not exist anywhere): TRYAGAIN until the
        # migration ends, then the target's MOVED.
        pending = asyncio.create_task(_admit(pipe, record.id, record.key_hash, 2))
        await asyncio.get_running_loop().run_in_executor(None, lambda: _finish(cluster, slot, target))
        statuses.append(await pending)
        assert pipe.num_redirects > asked
        statuses += [await _admit(pipe, record.id, record.key_hash, n) for n in range(3, 8)]
        assert statuses == ["ok"] * 6 + ["rate_limit_exceeded"] * 2  # one RPM log, wherever it lives
        assert int(target.command("ZCARD", redis_names.key_rpm_log(record.id))) == 6
        assert target.command("HGET", redis_names.key_record(record.id), "name") == "moved"
    finally:
        await pipe.aclose()


async def test_write_probe_says_no_while_a_shard_is_down_and_recovers(
    cluster: LocalCluster, client: RedisClient
) -> None:
    assert await is_writable(client)
    victim = cluster.nodes[1]
    victim.stop(kill=True)
    assert not await is_writable(client)  # its slots have no primary (and no replica to promote)
    wait_until(lambda: "cluster_state:fail" in str(cluster.nodes[0].command("CLUSTER", "INFO")), timeout_s=10,
               what="the cluster to notice")  # fmt: skip
    assert not await is_writable(client)  # CLUSTERDOWN on the surviving shards too
    victim.start()  # same port and nodes.conf: it rejoins with its slots
    cluster.wait_ok()
    deadline = time.monotonic() + 10
    while not await is_writable(client):
        assert time.monotonic() < deadline, "the write probe did not recover"
        await asyncio.sleep(0.05)


async def test_crossslot_is_a_bug_of_ours_not_an_outage(client: RedisClient) -> None:
    assert isinstance(client, RedisCluster)
    pipe = ClusterCommandPipe(client)
    try:
        with pytest.raises(ScriptError) as caught:  # two keys of two slots in one script call
            await DEFAULT_SCRIPTS.update(pipe, ("ug:{a}:key", "ug:{b}:key"), ["name", "x"])
        assert "hash to the same slot" in caught.value.detail
    finally:
        await pipe.aclose()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (MovedError("3999 127.0.0.1:6381", status_code="MOVED"), "no outage"),
        (AskError("3999 127.0.0.1:6381", status_code="ASK"), "no outage"),
        (TryAgainError("Multiple keys request during rehashing of slot", status_code="TRYAGAIN"), "no outage"),
        (ReadOnlyError("You can't write against a read only replica.", status_code="READONLY"), "no outage"),
        (ResponseError("Error running script (call to f_1): @user_script:57: -READONLY You can't write"), "no outage"),
        (ClusterDownError("The cluster is down", status_code="CLUSTERDOWN"), "outage"),
        (ConnectionError("Connection refused"), "outage"),
        (ClusterCrossSlotError("Keys in request don't hash to the same slot"), "bug"),
        (ResponseError("Error running script (call to f_1): @user_script:12: attempt to compare nil"), "bug"),
    ],
)
def test_what_a_failure_is(error: Exception, expected: str) -> None:
    classified = scripts.classify_failure(error, DEFAULT_SCRIPTS.admit)
    if expected == "bug":
        assert isinstance(classified, ScriptError)
    else:
        assert isinstance(classified, StorageError) and classified.is_outage == (expected == "outage")
