"""A deployment's `max_in_flight` waiters are served in fair order across tenants (priority class, then hand-offs
per weight, FIFO within a tenant), through the real `RedisUpstreamLimiter` of two `RedisAccess` instances (two
gateways) on one Redis. With one slot, each release hands it to exactly one waiter, so the order in which the
waiters get their leases is the hand-off order."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from auth import redis_names, scripts
from auth.access import RedisAccess
from auth.base import Priority, UpstreamLease

DEP = "dep"


class Turns:
    """Waiters that hand their lease to the test as soon as they hold it; the test releases them one by one."""

    def __init__(self) -> None:
        self.granted: asyncio.Queue[tuple[str, UpstreamLease, RedisAccess]] = asyncio.Queue()
        self.tasks: list[asyncio.Task[None]] = []

    def wait(
        self, access: RedisAccess, tenant: str, *, weight: float = 1.0, priority: Priority = "normal", label: str = ""
    ) -> None:
        async def run() -> None:
            lease = await access.upstream_limiter.acquire_upstream(
                DEP, max_in_flight=1, timeout_s=60, tenant=tenant, weight=weight, priority=priority
            )
            await self.granted.put((label or tenant, lease, access))

        self.tasks.append(asyncio.create_task(run()))

    async def serve(self, num_handoffs: int) -> list[str]:
        """Release each holder as it is served: the order of the next `num_handoffs` hand-offs."""
        order = []
        for _ in range(num_handoffs):
            who, lease, access = await asyncio.wait_for(self.granted.get(), 30)
            order.append(who)
            await access.upstream_limiter.release_upstream(lease)
        return order

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(1000):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the waiters did not all queue within 10 s")


def queued(redis: Redis, lines: dict[tuple[Priority, str], int]) -> Callable[[], Awaitable[bool]]:
    """A check that each tenant's line holds as many waiters as given."""

    async def check() -> bool:
        for (priority, tenant), num_waiting in lines.items():
            if await redis.llen(redis_names.upstream_line(DEP, priority, tenant)) != num_waiting:
                return False
        return True

    return check


async def hold_the_slot(access: RedisAccess) -> UpstreamLease:
    lease = await access.upstream_limiter.acquire_upstream(DEP, max_in_flight=1, timeout_s=5, tenant="holder")
    assert lease.lease_id
    return lease


async def test_a_tenants_burst_does_not_hold_another_tenant_behind_it(make_access: Any, redis: Redis) -> None:
    one, two = await make_access(), await make_access()
    holder = await hold_the_slot(one)
    turns = Turns()
    try:
        for _ in range(20):
            turns.wait(one, "team-a")
        await until(queued(redis, {("normal", "team-a"): 20}))
        for _ in range(2):
            turns.wait(two, "team-b")  # the other gateway
        await until(queued(redis, {("normal", "team-b"): 2}))

        await one.upstream_limiter.release_upstream(holder)
        order = await turns.serve(22)
    finally:
        await turns.aclose()
    assert "team-b" in order[:2], order  # B's first request at the next hand-off but one at the latest
    assert order[:4].count("team-b") == 2, order  # and its second in the hand-offs after: turn about with A
    assert order.count("team-a") == 20  # every one of A's burst is still served


async def test_weights_share_the_hand_offs_three_to_one(make_access: Any, redis: Redis) -> None:
    one, two = await make_access(), await make_access()
    holder = await hold_the_slot(one)
    turns = Turns()
    try:
        for _ in range(44):
            turns.wait(one, "team-a", weight=3)
            turns.wait(two, "team-b", weight=1)
        await until(queued(redis, {("normal", "team-a"): 44, ("normal", "team-b"): 44}))
        await one.upstream_limiter.release_upstream(holder)
        served = Counter(await turns.serve(40))  # both still backlogged at the end
    finally:
        await turns.aclose()
    assert 2.7 <= served["team-a"] / served["team-b"] <= 3.3, served


async def test_a_high_priority_waiter_goes_ahead_and_a_low_one_after(make_access: Any, redis: Redis) -> None:
    access = await make_access()
    holder = await hold_the_slot(access)
    turns = Turns()
    try:
        for _ in range(5):
            turns.wait(access, "team-a")
        turns.wait(access, "team-l", priority="low")
        await until(queued(redis, {("normal", "team-a"): 5, ("low", "team-l"): 1}))
        turns.wait(access, "team-h", priority="high")
        await until(queued(redis, {("high", "team-h"): 1}))
        await access.upstream_limiter.release_upstream(holder)
        order = await turns.serve(7)
    finally:
        await turns.aclose()
    assert order == ["team-h", *["team-a"] * 5, "team-l"]


async def test_an_expired_waiter_is_skipped_and_its_tenant_leaves(make_access: Any, redis: Redis) -> None:
    access = await make_access()
    holder = await hold_the_slot(access)
    # A waiter whose gateway died: it queued with a 1 ms wait and never comes back.
    is_held, _ = await scripts.acquire_upstream(
        redis,
        deployment=DEP,
        lease_id="ghost-1",
        max_in_flight=1,
        lease_ttl_ms=60_000,
        wait_timeout_ms=1,
        queue_entry="",
        handoff_ttl_ms=5_000,
        tenant="team-ghost",
    )
    assert not is_held
    await asyncio.sleep(0.05)  # past its deadline
    turns = Turns()
    try:
        turns.wait(access, "team-b")
        await until(queued(redis, {("normal", "team-b"): 1}))
        await access.upstream_limiter.release_upstream(holder)
        assert await turns.serve(1) == ["team-b"]
    finally:
        await turns.aclose()
    assert await redis.zscore(redis_names.upstream_leases(DEP), "ghost-1") is None
    # Nobody waits any more: no line and no tenant is left behind.
    for priority in ("high", "normal", "low"):
        assert not await redis.exists(redis_names.upstream_tenants(DEP, priority))
    assert not await redis.exists(redis_names.upstream_line(DEP, "normal", "team-ghost"))
    assert not await redis.exists(redis_names.upstream_line(DEP, "normal", "team-b"))


async def test_waiters_of_the_previous_version_are_served_first(make_access: Any, redis: Redis) -> None:
    """Rolling upgrade: a gateway of the previous version queued its waiters in the one FIFO list, and is woken
    through the same wake-up lists; they are served before the fair lines, an expired one is dropped."""
    access = await make_access()
    holder = await hold_the_slot(access)
    turns = Turns()
    try:
        turns.wait(access, "team-a")
        await until(queued(redis, {("normal", "team-a"): 1}))
        now_ms = int((await redis.time())[0]) * 1000
        legacy = redis_names.upstream_queue(DEP)
        await redis.rpush(legacy, f"old-expired|{now_ms - 1}", f"old-waiter|{now_ms + 60_000}")

        await access.upstream_limiter.release_upstream(holder)
        assert await redis.zscore(redis_names.upstream_leases(DEP), "old-waiter") is not None  # handed the slot
        assert await redis.lpop(redis_names.upstream_wake(DEP, "old-waiter")) == b"1"  # and woken
        assert not await redis.exists(legacy)
        assert turns.granted.empty()
        await scripts.release_upstream(
            redis, deployment=DEP, lease_id="old-waiter", queue_entry="", handoff_ttl_ms=5_000
        )
        assert await turns.serve(1) == ["team-a"]
    finally:
        await turns.aclose()


def test_both_scripts_hand_off_with_the_one_shared_function() -> None:
    """The hand-off is written once (`_fair_handoff.lua`) and each script's prelude carries it."""
    shared = (Path(scripts.__file__).parent / "lua" / "_fair_handoff.lua").read_text()
    for script in (scripts.DEFAULT_SCRIPTS.acquire, scripts.DEFAULT_SCRIPTS.release):
        prelude = "\n".join(script.source.splitlines()[: script.num_prelude_lines])
        assert shared.strip() in prelude and "local function hand_off" not in script.source[len(prelude) :]
