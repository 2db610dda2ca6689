"""The upstream fair queue, proven against a reference model: the real `acquire_upstream` / `release_upstream`
scripts on a real Redis next to a small pure-Python model of the order they must keep. Hypothesis picks the
steps (waiters of a few tenants, weights and priority classes arrive, poll again, give up, are released; holders
release; the clock moves past deadlines and lease expiries; a gateway of the previous version queues in the old
FIFO list); after every step the leases, the lines, the tenants' virtual counters and the old list in Redis must
equal the model's, and no tenant without waiters may be left behind.

Time: `ScriptSet(clock_key=...)` makes `now_ms()` read an integer from a key the test sets (as in
test_accounting_model.py). The key carries the deployment's hash tag, so the scripts run on a Redis Cluster too.
Weights are powers of two, so the counters (sums of 1 / weight) are exact in both Redis and Python.

`UNIGATE_UPSTREAM_FAIR_EXAMPLES` raises the number of examples (default 30).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from auth import redis_names, scripts
from auth.redis_client import connect
from auth.scripts import ScriptSet

DEP = "dep"
CLOCK_KEY = redis_names.upstream_prefix(DEP) + "test_clock"
CLASSES = ("high", "normal", "low")
TENANTS = ("a", "b", "")
LEASE_TTL_MS = 600_000
HANDOFF_TTL_MS = 5_000
START_MS = 1_767_225_600_000
NUM_EXAMPLES = int(os.environ.get("UNIGATE_UPSTREAM_FAIR_EXAMPLES", "30"))


@dataclass
class Waiter:
    lease_id: str
    tenant: str
    weight: float
    priority: str
    wait_ms: int
    entry: str = ""


@dataclass
class FairQueueModel:
    """What the scripts must do, in plain Python (one deployment)."""

    max_in_flight: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # lease id -> expiry (ms)
    legacy: deque[tuple[str, int]] = field(default_factory=deque)  # (lease id, deadline)
    lines: dict[tuple[str, str], deque[tuple[str, int, float]]] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(default_factory=lambda: {c: {} for c in CLASSES})

    def expire(self, now: int) -> None:
        self.leases = {lease: expiry for lease, expiry in self.leases.items() if expiry > now}

    def _lowest(self, priority: str) -> float:
        return min(self.counters[priority].values(), default=0.0)

    def _next_waiter(self, now: int) -> str | None:
        while self.legacy:
            lease_id, deadline = self.legacy.popleft()
            if deadline >= now:
                return lease_id
        for priority in CLASSES:
            counters = self.counters[priority]
            while counters:
                tenant = min(counters, key=lambda t: (counters[t], t.encode()))
                line = self.lines.get((priority, tenant), deque())
                while line:
                    lease_id, deadline, weight = line.popleft()
                    if deadline >= now:
                        if line:
                            counters[tenant] += 1 / weight
                        else:
                            del counters[tenant]
                        return lease_id
                del counters[tenant]
        return None

    def hand_off(self, now: int) -> list[str]:
        handed = []
        while len(self.leases) < self.max_in_flight:
            lease_id = self._next_waiter(now)
            if lease_id is None:
                break
            self.leases[lease_id] = now + HANDOFF_TTL_MS
            handed.append(lease_id)
        return handed

    def acquire(self, waiter: Waiter, now: int, max_in_flight: int) -> tuple[bool, str]:
        self.max_in_flight = max_in_flight
        self.expire(now)

        def hold() -> tuple[bool, str]:
            self.leases[waiter.lease_id] = now + LEASE_TTL_MS
            return True, ""

        if waiter.lease_id in self.leases:
            return hold()
        line = self.lines.setdefault((waiter.priority, waiter.tenant), deque())
        counters = self.counters[waiter.priority]
        entry = waiter.entry
        if entry == "":
            anyone_waits = bool(self.legacy) or any(self.counters[c] for c in CLASSES)
            if len(self.leases) < max_in_flight and not anyone_waits:
                return hold()
            deadline = now + waiter.wait_ms
            entry = f"{waiter.lease_id}|{deadline}|{float(waiter.weight)!r}"
            if waiter.tenant not in counters:
                counters[waiter.tenant] = self._lowest(waiter.priority)
            line.append((waiter.lease_id, deadline, waiter.weight))
        elif line and waiter.tenant not in counters:
            counters[waiter.tenant] = self._lowest(waiter.priority)
        if len(self.leases) < max_in_flight:
            self.hand_off(now)
            if waiter.lease_id in self.leases:
                return hold()
        return False, entry

    def release(self, lease_id: str, waiter: Waiter | None, now: int) -> None:
        self.leases.pop(lease_id, None)
        if waiter is not None and waiter.entry:
            line = self.lines.get((waiter.priority, waiter.tenant), deque())
            for item in line:
                if item[0] == lease_id:
                    line.remove(item)
                    break
            if not line:
                self.counters[waiter.priority].pop(waiter.tenant, None)
        self.expire(now)
        self.hand_off(now)


class FairQueueMachine(RuleBasedStateMachine):
    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis = connect(self.redis_url)
        self.run(self.redis.flushall())
        self.scripts = ScriptSet(clock_key=CLOCK_KEY)
        self.now = START_MS
        self.run(self.redis.set(CLOCK_KEY, self.now))
        self.model = FairQueueModel()
        self.ids = itertools.count()
        self.waiting: list[Waiter] = []
        self.holding: list[Waiter] = []
        self.max_in_flight = 1
        self.old_waiters: list[Waiter] = []

    @initialize(max_in_flight=st.integers(1, 3))
    def configure(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        self.run(self.redis.aclose())
        self.loop.close()

    def _acquire(self, waiter: Waiter, max_in_flight: int) -> None:
        expected = self.model.acquire(waiter, self.now, max_in_flight)
        got = self.run(
            scripts.acquire_upstream(
                self.redis,
                deployment=DEP,
                lease_id=waiter.lease_id,
                max_in_flight=max_in_flight,
                lease_ttl_ms=LEASE_TTL_MS,
                wait_timeout_ms=waiter.wait_ms,
                queue_entry=waiter.entry,
                handoff_ttl_ms=HANDOFF_TTL_MS,
                tenant=waiter.tenant,
                weight=waiter.weight,
                priority=waiter.priority,
                scripts=self.scripts,
            )
        )
        assert got == expected
        is_held, waiter.entry = got
        (self.holding if is_held else self.waiting).append(waiter)

    def _release(self, waiter: Waiter) -> None:
        self.model.release(waiter.lease_id, waiter, self.now)
        self.run(
            scripts.release_upstream(
                self.redis,
                deployment=DEP,
                lease_id=waiter.lease_id,
                queue_entry=waiter.entry,
                handoff_ttl_ms=HANDOFF_TTL_MS,
                tenant=waiter.tenant,
                priority=waiter.priority,
                scripts=self.scripts,
            )
        )

    @rule(
        tenant=st.sampled_from(TENANTS),
        weight=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
        priority=st.sampled_from(["normal", "normal", "normal", "high", "low"]),
        wait_ms=st.integers(1, 30_000),
        num_waiters=st.integers(1, 4),
    )
    def arrive(self, tenant: str, weight: float, priority: str, wait_ms: int, num_waiters: int) -> None:
        """A burst of one tenant's requests (one weight and class: its team's)."""
        for _ in range(num_waiters):
            self._acquire(Waiter(f"w{next(self.ids)}", tenant, weight, priority, wait_ms), self.max_in_flight)

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 1_000))
    def poll_again(self, pick: int) -> None:
        """A waiter comes back (woken, or its poll interval passed): it holds a slot now, or waits on."""
        self._acquire(self.waiting.pop(pick % len(self.waiting)), self.max_in_flight)

    @rule(max_in_flight=st.integers(1, 3))
    def change_max_in_flight(self, max_in_flight: int) -> None:
        """The operator changes the cap; the next call to a script stores it."""
        self.max_in_flight = max_in_flight

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 1_000))
    def give_up(self, pick: int) -> None:
        """A waiter times out or its client leaves (a slot handed to it meanwhile passes on)."""
        self._release(self.waiting.pop(pick % len(self.waiting)))

    @precondition(lambda self: self.holding)
    @rule(pick=st.integers(0, 1_000))
    def release(self, pick: int) -> None:
        self._release(self.holding.pop(pick % len(self.holding)))

    @rule(wait_ms=st.integers(1, 30_000))
    def old_gateway_queues(self, wait_ms: int) -> None:
        """A gateway of the previous version queues a waiter in the one FIFO list (its own scripts poll it; here it
        only counts as holding once a hand-off gave it a slot, and is then released through the new script)."""
        lease_id = f"old{next(self.ids)}"
        self.model.legacy.append((lease_id, self.now + wait_ms))
        self.old_waiters.append(Waiter(lease_id, "", 1.0, "normal", wait_ms))
        self.run(self.redis.rpush(redis_names.upstream_queue(DEP), f"{lease_id}|{self.now + wait_ms}"))

    @rule(ms=st.integers(1, 2_000) | st.sampled_from([HANDOFF_TTL_MS, 30_000]))
    def advance(self, ms: int) -> None:
        self.now += ms
        self.run(self.redis.set(CLOCK_KEY, self.now))

    @invariant()
    def old_waiters_handed_a_slot_hold_it(self) -> None:
        for waiter in [w for w in self.old_waiters if w.lease_id in self.model.leases]:
            self.old_waiters.remove(waiter)
            self.holding.append(waiter)

    @invariant()
    def redis_equals_model(self) -> None:
        self.run(self._check())

    async def _check(self) -> None:
        model, redis = self.model, self.redis
        leases = await redis.zrange(redis_names.upstream_leases(DEP), 0, -1, withscores=True)
        live = {m.decode(): int(s) for m, s in leases if s > self.now}
        assert live == {lease: expiry for lease, expiry in model.leases.items() if expiry > self.now}
        legacy = [e.decode() for e in await redis.lrange(redis_names.upstream_queue(DEP), 0, -1)]
        assert legacy == [f"{lease}|{deadline}" for lease, deadline in model.legacy]
        for priority in CLASSES:
            members = await redis.zrange(redis_names.upstream_tenants(DEP, priority), 0, -1, withscores=True)
            counters = {m.decode(): s for m, s in members}
            assert counters == model.counters[priority]
            for tenant in TENANTS:
                line = [e.decode() for e in await redis.lrange(redis_names.upstream_line(DEP, priority, tenant), 0, -1)]
                expected = model.lines.get((priority, tenant), deque())
                assert line == [f"{lease}|{deadline}|{weight!r}" for lease, deadline, weight in expected]
                # Bounded memory: a tenant is listed exactly while it has waiters (expired ones leave at a hand-off).
                assert (tenant in counters) == bool(line)


@pytest.mark.timeout(600)
def test_upstream_fair_queue_matches_the_reference_model(redis_url: str) -> None:
    FairQueueMachine.redis_url = redis_url
    run_state_machine_as_test(
        FairQueueMachine,
        settings=settings(
            max_examples=NUM_EXAMPLES,
            stateful_step_count=100,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
