"""Redis killed and restarted under a running `RedisAccess`, in both failure modes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.net import free_port

from auth.base import SettleUsage
from auth.embedded_redis import EmbeddedRedis
from auth.redis_client import connect
from auth.scripts import DEFAULT_SCRIPTS
from auth.store import KeyStore
from gateway.errors import GatewayError, LimitError, UnavailableError


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    embedded = EmbeddedRedis(tmp_path / "redis", port=free_port())
    embedded.start()
    yield embedded
    embedded.stop()


async def _eventually_admitted(access: Any, secret: str, timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await access.admit(secret, model="m", estimated_tokens=1)
        except UnavailableError:
            assert time.monotonic() < deadline, "did not recover after Redis came back"
            await asyncio.sleep(0.1)


async def test_fail_closed_serves_cached_keys_only_and_recovers(make_access: Any, server: EmbeddedRedis) -> None:
    admin = connect(server.url)
    store = KeyStore(admin)
    _, cached_secret = await store.create({"rpm": 3})
    _, cold_secret = await store.create({})
    access = await make_access(server.url, key_cache_ttl_s=30.0)
    await access.admit(cached_secret, model="m", estimated_tokens=1)

    server.stop(kill=True)
    started = time.monotonic()
    bypassed = await access.admit(cached_secret, model="m", estimated_tokens=1)  # verified moments ago
    assert bypassed.headers == {}
    with pytest.raises(UnavailableError) as caught:
        await access.admit(cold_secret, model="m", estimated_tokens=1)
    assert caught.value.code == "limits_unavailable" and caught.value.headers["retry-after"] == "1"
    await access.settle(bypassed, SettleUsage(1, 1))  # never raises
    assert not await access.ping()
    assert time.monotonic() - started < 3.0, "a dead Redis must not hang requests"
    assert access.num_limit_bypasses >= 1 and access.num_storage_errors >= 1

    server.start()  # same port, same data directory: the keys survive
    await admin.aclose()
    admin = connect(server.url)
    await admin.script_flush()  # Redis 7+ forgets scripts on restart (6.2 replays them from the AOF)
    assert not any(await admin.script_exists(*(s.sha for s in DEFAULT_SCRIPTS.all)))
    await _eventually_admitted(access, cold_secret)
    assert await access.ping()
    admit_sha = DEFAULT_SCRIPTS.admit.sha
    assert await admin.script_exists(admit_sha) == [True]  # re-registered on NOSCRIPT
    with pytest.raises(LimitError):  # limits apply again (RPM 3)
        for _ in range(4):
            await access.admit(cached_secret, model="m", estimated_tokens=1)
    await admin.aclose()


async def test_fail_closed_cache_lifetime_ends(make_access: Any, server: EmbeddedRedis) -> None:
    admin = connect(server.url)
    _, secret = await KeyStore(admin).create({})
    access = await make_access(server.url, key_cache_ttl_s=0.2)
    await access.admit(secret, model="m", estimated_tokens=1)
    server.stop(kill=True)
    await asyncio.sleep(0.3)
    with pytest.raises(UnavailableError):
        await access.admit(secret, model="m", estimated_tokens=1)
    await admin.aclose()


async def test_fail_open_skips_limits_and_recovers(make_access: Any, server: EmbeddedRedis) -> None:
    admin = connect(server.url)
    store = KeyStore(admin)
    _, secret = await store.create({"rpm": 2, "models": ["m"]})
    _, cold_secret = await store.create({})
    access = await make_access(server.url, key_cache_ttl_s=0.1, redis_failure_mode="open")
    await access.admit(secret, model="m", estimated_tokens=1)
    await asyncio.sleep(0.2)  # past the cache lifetime: open mode still serves a key it has verified

    server.stop(kill=True)
    for _ in range(5):  # over the RPM of 2: limits are skipped
        admission = await access.admit(secret, model="m", estimated_tokens=1)
        await access.settle(admission, SettleUsage(1, 1))
    with pytest.raises(GatewayError) as not_allowed:
        await access.admit(secret, model="other", estimated_tokens=1)  # the allowlist still holds
    assert not_allowed.value.code == "model_not_allowed"
    with pytest.raises(UnavailableError):  # a key never verified cannot be served
        await access.admit(cold_secret, model="m", estimated_tokens=1)
    lease = await access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=1)
    assert lease.lease_id is None  # no cap without Redis, counted
    assert access.num_limit_bypasses >= 6

    server.start()
    await _eventually_admitted(access, cold_secret)
    with pytest.raises(LimitError):  # limits apply again (RPM 2)
        for _ in range(3):
            await access.admit(secret, model="m", estimated_tokens=1)
    await admin.aclose()


@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_a_redis_that_refuses_the_gateways_credentials_never_opens_the_bypass(
    make_access: Any, server: EmbeddedRedis, mode: str
) -> None:
    """A password set on Redis (or a wrong one in REDIS_URL) is the operator's misconfiguration, not an outage:
    every key gets 503 naming the credentials, even a cached key in open mode, until the URL is fixed."""
    admin = connect(server.url)
    _, secret = await KeyStore(admin).create({"rpm": 2})
    access = await make_access(server.url, key_cache_ttl_s=30.0, redis_failure_mode=mode)
    await access.admit(secret, model="m", estimated_tokens=1)
    try:
        await admin.config_set("requirepass", "s3cret")
        await admin.execute_command("CLIENT", "KILL", "TYPE", "normal")  # every connection must authenticate again
        # A killed connection is a short outage (the next call finds it closed; then the gateway skips Redis for
        # 0.5 s); once it reconnects and Redis asks for a password, nothing is served without its limits.
        with contextlib.suppress(UnavailableError):
            await access.admit(secret, model="m", estimated_tokens=1)
        await asyncio.sleep(0.6)
        bypasses = access.num_limit_bypasses
        for _ in range(3):
            with pytest.raises(UnavailableError) as caught:
                await access.admit(secret, model="m", estimated_tokens=1)
            assert caught.value.code == "limits_unavailable", caught.value.message
        assert access.num_limit_bypasses == bypasses
    finally:
        fixed = connect(server.url.replace("redis://", "redis://:s3cret@"))
        await fixed.config_set("requirepass", "")
        await fixed.aclose()
        await admin.aclose()


async def test_a_settle_lost_to_a_short_outage_is_sent_again_when_redis_answers(
    make_access: Any, server: EmbeddedRedis
) -> None:
    """Redis restarting while a `max_concurrent: 1` key's request ends: the settle fails, and was dropped, so the
    lease (saved with the data) locked the key out for `lease_ttl_s` (10 minutes). Kept and sent again once Redis
    answers, it frees the slot and charges the usage exactly once."""
    admin = connect(server.url)
    created, secret = await KeyStore(admin).create({"max_concurrent": 1})
    access = await make_access(server.url)
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    server.stop()  # saves its data, the lease included, and exits
    await access.settle(admission, SettleUsage(5, 7))  # refused: kept for later
    assert access.num_storage_errors >= 1
    server.start()
    await admin.aclose()
    admin = connect(server.url)
    deadline = time.monotonic() + 5.0
    while True:
        bypasses = access.num_limit_bypasses
        try:
            await access.admit(secret, model="m", estimated_tokens=1)
            if access.num_limit_bypasses == bypasses:  # checked by Redis (not the cached key's bypass): slot free
                break
        except (LimitError, UnavailableError):  # the lease holds the slot, or Redis is not back yet
            assert time.monotonic() < deadline, "the lost settle was not sent again: its lease holds the slot"
        await asyncio.sleep(0.1)
    record = await KeyStore(admin).get(created.id)
    assert (record.prompt_tokens, record.completion_tokens, record.num_requests) == (5, 7, 1)
    await admin.aclose()
