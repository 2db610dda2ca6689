"""Settles batched per key on the command pipe (through `RedisAccess.begin_settle`), against a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

from auth.base import SettleUsage
from auth.store import KeyStore


async def test_settles_queued_together_share_one_script_call_and_add_up(
    make_access: Any, new_key: Any, store: KeyStore, redis: Any
) -> None:
    access = await make_access()
    key_id, secret = await new_key(tpm=100_000, max_concurrent=100)
    admissions = await asyncio.gather(
        *(access.admit(secret, model=f"m{i % 2}", estimated_tokens=100) for i in range(40))
    )
    assert all(a.headers for a in admissions)
    await redis.execute_command("CONFIG", "RESETSTAT")
    await asyncio.gather(*(access.settle(a, SettleUsage(i, 2 * i)) for i, a in enumerate(admissions)))
    calls = (await redis.info("commandstats"))["cmdstat_evalsha"]["calls"]
    assert calls < 40  # batched (one call for all 40 when they are queued in one go)

    record = await store.get(key_id)
    used = sum(3 * i for i in range(40))
    assert (record.num_requests, record.tokens_spent) == (40, used)
    rows = {row.model: row for row in await store.usage(key_id)}
    assert rows["m0"].num_requests == rows["m1"].num_requests == 20
    assert rows["m0"].prompt_tokens == sum(range(0, 40, 2)) and rows["m1"].prompt_tokens == sum(range(1, 40, 2))
    assert rows["m1"].completion_tokens == 2 * sum(range(1, 40, 2))
    # Every lease is free and the token log holds the real usage, not the reservations.
    nxt = await access.admit(secret, model="m0", estimated_tokens=0)
    assert nxt.headers["x-ratelimit-remaining-tokens"] == str(100_000 - used)
    assert await redis.zcard(f"ug:{{{key_id}}}:leases") == 1


async def test_an_admission_after_a_queued_settle_sees_it_done(make_access: Any, new_key: Any) -> None:
    """The settle is not awaited, only queued: the next admit on this instance still finds the lease free."""
    access = await make_access()
    _, secret = await new_key(max_concurrent=1, tpm=1000)
    for _ in range(20):
        admission = await access.admit(secret, model="m", estimated_tokens=900)
        settling = access.begin_settle(admission, SettleUsage(1, 1))
        nxt = await access.admit(secret, model="m", estimated_tokens=900)  # lease and 899 tokens freed first
        access.begin_settle(nxt, SettleUsage(0, 0))
        await settling


async def test_a_batched_settle_after_redis_lost_its_scripts_registers_them_again(
    make_access: Any, new_key: Any, store: KeyStore, redis: Any
) -> None:
    access = await make_access()
    key_id, secret = await new_key(max_concurrent=5)
    admissions = [await access.admit(secret, model="m", estimated_tokens=10) for _ in range(3)]
    await redis.script_flush()  # as after a Redis restart without persistence of scripts
    await asyncio.gather(*(access.settle(a, SettleUsage(2, 3)) for a in admissions))
    record = await store.get(key_id)
    assert (record.num_requests, record.tokens_spent) == (3, 15)
    assert await redis.zcard(f"ug:{{{key_id}}}:leases") == 0
