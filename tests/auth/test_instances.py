"""Two `RedisAccess` instances (separate clients, like two gateway processes) sharing one Redis."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from auth import redis_names
from auth.base import UpstreamLease
from auth.store import KeyStore
from gateway.errors import AuthError, UnavailableError


async def test_two_instances_enforce_one_rpm(make_access: Any, new_key: Any) -> None:
    one, two = await make_access(), await make_access()
    _, secret = await new_key(rpm=30)
    calls = [access.admit(secret, model="m", estimated_tokens=1) for access in (one, two) for _ in range(40)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 30


async def test_revocation_reaches_the_other_instance_within_a_second(
    make_access: Any, new_key: Any, store: KeyStore
) -> None:
    one, two = await make_access(key_cache_ttl_s=60.0), await make_access(key_cache_ttl_s=60.0)
    key_id, secret = await new_key()
    await one.authenticate(secret)  # cached in `one` for a minute
    await asyncio.sleep(0.2)  # let both listeners subscribe
    await two.admit(secret, model="m", estimated_tokens=1)
    await store.revoke(key_id)
    revoked_at = time.monotonic()
    with pytest.raises(AuthError) as admitted:
        await two.admit(secret, model="m", estimated_tokens=1)  # the script reads the record: immediate
    assert admitted.value.code == "key_revoked"
    while True:
        try:
            await one.authenticate(secret)
        except AuthError as exc:
            assert exc.code == "key_revoked"
            break
        assert time.monotonic() - revoked_at < 1.0, "revocation did not reach the cached copy within 1 s"
        await asyncio.sleep(0.02)


async def test_upstream_cap_is_shared_and_waiters_are_served_in_order(make_access: Any, redis: Redis) -> None:
    one, two = await make_access(), await make_access()
    held = [
        await one.upstream_limiter.acquire_upstream("dep", max_in_flight=2, timeout_s=5),
        await two.upstream_limiter.acquire_upstream("dep", max_in_flight=2, timeout_s=5),
    ]
    assert all(lease.lease_id for lease in held)
    served: list[str] = []

    async def wait(access: Any, name: str) -> UpstreamLease:
        lease: UpstreamLease = await access.upstream_limiter.acquire_upstream("dep", max_in_flight=2, timeout_s=5)
        served.append(name)
        return lease

    first = asyncio.create_task(wait(two, "first"))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(wait(one, "second"))
    await asyncio.sleep(0.1)
    assert served == [] and await redis.llen(redis_names.upstream_line("dep", "normal", "")) == 2

    started = time.monotonic()
    await one.upstream_limiter.release_upstream(held[0])
    lease = await first
    assert served == ["first"] and time.monotonic() - started < 0.9  # woken by the hand-off, not by polling
    await two.upstream_limiter.release_upstream(held[1])
    await second
    assert served == ["first", "second"]
    assert await redis.zcard(redis_names.upstream_leases("dep")) == 2
    await one.upstream_limiter.release_upstream(lease)


async def test_at_capacity_times_out_with_503_and_leaves_the_queue(make_access: Any, redis: Redis) -> None:
    access = await make_access()
    await access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=1)
    with pytest.raises(UnavailableError) as caught:
        await access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=0.3)
    assert caught.value.code == "upstream_at_capacity" and caught.value.headers["retry-after"] == "1"
    assert await redis.llen(redis_names.upstream_line("dep", "normal", "")) == 0


async def test_cancelled_waiter_passes_its_turn_on(make_access: Any, redis: Redis) -> None:
    access = await make_access()
    holder = await access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=1)
    quitter = asyncio.create_task(access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=5))
    await asyncio.sleep(0.1)
    patient = asyncio.create_task(access.upstream_limiter.acquire_upstream("dep", max_in_flight=1, timeout_s=5))
    await asyncio.sleep(0.1)
    quitter.cancel()  # the client disconnected while waiting
    await asyncio.sleep(0.1)
    await access.upstream_limiter.release_upstream(holder)
    lease = await asyncio.wait_for(patient, 2)
    assert lease.lease_id and await redis.llen(redis_names.upstream_line("dep", "normal", "")) == 0


async def test_upstream_leases_of_a_crashed_instance_expire(make_access: Any) -> None:
    crashed = (await make_access(lease_ttl_s=0.5)).upstream_limiter
    await crashed.acquire_upstream("dep", max_in_flight=1, timeout_s=1)  # never released
    survivor = (await make_access(lease_ttl_s=0.5)).upstream_limiter
    lease = await survivor.acquire_upstream("dep", max_in_flight=1, timeout_s=3)  # polls past the expiry
    assert lease.lease_id


async def test_no_cap_means_no_lease(make_access: Any) -> None:
    access = await make_access()
    assert (await access.upstream_limiter.acquire_upstream("dep", max_in_flight=0, timeout_s=1)).lease_id is None
