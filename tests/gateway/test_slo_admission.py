"""SLO-aware admission as units: the fair queue (against a reference model), the AIMD limit, the queue's deadline
and size, the seed from a bench run file, and models without `slo` left alone."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.errors import OverloadedError
from gateway.fair_queue import FairQueue
from gateway.router import Router
from gateway.routing_config import RoutingConfigError, SloConfig, load_routing, parse_routing
from gateway.slo_admission import (
    DECREASE_FACTOR,
    MIN_EPOCH_REQUESTS,
    DeploymentSlo,
    TimedStream,
    percentile,
    slo_states,
    with_room,
)


@dataclass(frozen=True)
class Who:
    tenant: str = "t"
    weight: float = 1.0
    priority: str = "normal"


A, B = Who("a"), Who("b")


def slo(**fields: Any) -> SloConfig:
    return SloConfig.model_validate({"ttft_ms": 100, **fields})


# -- the fair queue -------------------------------------------------------------------------------------------


def drain(queue: FairQueue[str]) -> list[str]:
    out = []
    while (item := queue.pop()) is not None:
        out.append(item)
    return out


def test_tenants_take_turns_whatever_order_they_queued_in() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.push(f"a{i}", "a")
    queue.push("b0", "b")
    queue.push("b1", "b")
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_heavier_tenant_is_served_in_proportion_and_priority_classes_come_first() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.push(f"h{i}", "heavy", weight=2.0)
        queue.push(f"l{i}", "light", weight=1.0)
    queue.push("low", "c", priority="low")
    queue.push("high", "d", priority="high")
    order = drain(queue)
    assert order[0] == "high" and order[-1] == "low"
    assert order[1:9] == ["h0", "l0", "h1", "l1", "h2", "h3", "l2", "l3"]  # two of heavy per one of light


def test_an_idle_tenant_banks_no_credit() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(3):
        queue.push(f"a{i}", "a")
    assert queue.pop() == "a0" and queue.pop() == "a1"
    queue.push("b0", "b")  # joins at a's counter, not at 0: no run of b's ahead of a
    queue.push("b1", "b")
    assert drain(queue) == ["a2", "b0", "b1"]


class FairQueueMachine(RuleBasedStateMachine):
    """`FairQueue` against a plain reference: per class, per tenant FIFO lines and counters, the lowest (counter,
    head's arrival) served first; leavers taken out of their line."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: FairQueue[int] = FairQueue()
        self.entries: dict[int, Any] = {}
        self.lines: dict[tuple[int, str], deque[tuple[int, float]]] = {}  # (rank, tenant) -> (item, weight)
        self.counters: dict[tuple[int, str], float] = {}
        self.next_item = 0

    @rule(
        tenant=st.sampled_from("abc"),
        weight=st.sampled_from([0.5, 1.0, 3.0]),
        priority=st.sampled_from(["high", "normal", "low"]),
    )
    def push(self, tenant: str, weight: float, priority: str) -> None:
        item, self.next_item = self.next_item, self.next_item + 1
        rank = {"high": 0, "normal": 1, "low": 2}[priority]
        key = (rank, tenant)
        if key not in self.lines:
            self.lines[key] = deque()
            same_class = [c for (r, _), c in self.counters.items() if r == rank]
            self.counters[key] = min(same_class, default=0.0)
        self.lines[key].append((item, weight))
        self.entries[item] = self.queue.push(item, tenant, weight, priority)

    @rule()
    def pop(self) -> None:
        expected = None
        for rank in range(3):
            keys = [k for k in self.lines if k[0] == rank]
            if keys:
                key = min(keys, key=lambda k: (self.counters[k], self.lines[k][0][0]))
                expected, weight = self.lines[key].popleft()
                if self.lines[key]:
                    self.counters[key] += 1.0 / weight
                else:
                    del self.lines[key], self.counters[key]
                break
        assert self.queue.pop() == expected
        self.entries.pop(expected, None)  # type: ignore[arg-type]

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        item = data.draw(st.sampled_from(sorted(self.entries)))
        assert self.queue.remove(self.entries.pop(item))
        for key, line in list(self.lines.items()):
            kept = deque(e for e in line if e[0] != item)
            if len(kept) != len(line):
                if kept:
                    self.lines[key] = kept
                else:
                    del self.lines[key], self.counters[key]

    @invariant()
    def same_length(self) -> None:
        assert len(self.queue) == sum(len(line) for line in self.lines.values())


TestFairQueueMachine = FairQueueMachine.TestCase
TestFairQueueMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class AdmissionMachine(RuleBasedStateMachine):
    """`DeploymentSlo` driven on its own event loop by arrivals of three tenants and releases, against a reference:
    nobody waits while there is room (work-conserving), never more in flight than the limit, and the waiters start
    in exactly the order a reference fair queue (checked above) gives them."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.state = DeploymentSlo(slo(max_wait_ms=3_600_000, max_queue=1000), seed=2)
        self.reference: FairQueue[int] = FairQueue()
        self.expected: list[int] = []  # start order the reference predicts
        self.started: list[int] = []
        self.held: list[Any] = []
        self.next_id = 0

    def teardown(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()

    def settle(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    async def arrive_as(self, request_id: int, who: Who) -> None:
        ticket = await self.state.admit(who)
        self.started.append(request_id)
        self.held.append(ticket)

    @rule(tenant=st.sampled_from("abc"), weight=st.sampled_from([1.0, 2.0]))
    def arrive(self, tenant: str, weight: float) -> None:
        request_id, self.next_id = self.next_id, self.next_id + 1
        if self.state.has_room:
            self.expected.append(request_id)
        else:
            self.reference.push(request_id, tenant, weight)
        self.loop.create_task(self.arrive_as(request_id, Who(tenant, weight)))
        self.settle()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ticket = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.state.release(ticket)  # no sample: the limit stays
        if (request_id := self.reference.pop()) is not None:
            self.expected.append(request_id)
        self.settle()

    @invariant()
    def as_the_reference(self) -> None:
        assert self.started == self.expected
        assert self.state.num_admitted == len(self.held) <= self.state.limit
        assert self.state.num_queued == len(self.reference)
        assert self.state.num_queued == 0 or self.state.num_admitted == self.state.limit


TestAdmissionMachine = AdmissionMachine.TestCase
TestAdmissionMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# -- the limit (AIMD) -----------------------------------------------------------------------------------------


async def fill(state: DeploymentSlo, n: int) -> list[Any]:
    return [await state.admit(A) for _ in range(n)]


async def one_epoch(state: DeploymentSlo, ttft_s: float, tpot_s: float | None = None) -> None:
    """An epoch's worth of requests, each admitted with the limit fully used, then released with this latency."""
    for _ in range(state.epoch_size):
        tickets = await fill(state, state.limit - state.num_admitted)
        state.release(tickets[0] if tickets else await state.admit(A), ttft_s, tpot_s)
        for ticket in tickets[1:]:
            state.release(ticket)  # failed: no sample


async def test_the_limit_grows_by_one_while_the_slo_holds_at_full_use() -> None:
    state = DeploymentSlo(slo(), seed=4)
    await one_epoch(state, ttft_s=0.05)
    assert state.limit == 5
    await one_epoch(state, ttft_s=0.05)
    assert state.limit == 6


async def test_the_limit_does_not_grow_when_it_was_not_reached() -> None:
    state = DeploymentSlo(slo(), seed=4)
    for _ in range(3 * MIN_EPOCH_REQUESTS):
        state.release(await state.admit(A), 0.01)  # one at a time: never at the limit
    assert state.limit == 4


async def test_a_broken_slo_cuts_the_limit_and_the_requests_from_before_do_not_cut_it_again() -> None:
    state = DeploymentSlo(slo(tpot_ms=20), seed=8)
    first = await fill(state, 8)
    for ticket in first[:4]:
        state.release(ticket, 0.5)
    second = await fill(state, 4)  # the limit fully used again, by requests of the same generation
    for ticket in first[4:]:
        state.release(ticket, 0.5)  # the epoch's 8th sample: over the SLO
    assert state.limit == int(8 * DECREASE_FACTOR) == 5
    for ticket in second:
        state.release(ticket, 0.5)  # admitted under the old limit: no judgement of the new one
    assert state.limit == 5 and state.num_decreases == 1
    await one_epoch(state, ttft_s=0.05, tpot_s=0.05)  # TPOT breaks this time
    assert state.limit == 3
    for _ in range(4):
        await one_epoch(state, ttft_s=1.0)
    assert state.limit == 1  # the floor


async def test_without_a_seed_the_limit_starts_at_one_and_doubles_until_the_first_break() -> None:
    state = DeploymentSlo(slo(max_limit=12))
    assert state.limit == 1
    limits = []
    for _ in range(4):
        await one_epoch(state, ttft_s=0.05)
        limits.append(state.limit)
    assert limits == [2, 4, 8, 12]  # the ceiling
    await one_epoch(state, ttft_s=0.5)
    assert state.limit == 8 and not state.is_slow_start
    await one_epoch(state, ttft_s=0.05)
    assert state.limit == 9


async def test_slow_start_ends_when_the_latency_nears_the_slo() -> None:
    state = DeploymentSlo(slo())
    assert state.epoch_size == 1  # one round of the limit
    await one_epoch(state, ttft_s=0.05)
    assert state.limit == 2
    await one_epoch(state, ttft_s=0.09)  # within the SLO, but past SLOW_START_EXIT of it
    assert state.limit == 3 and not state.is_slow_start
    assert state.epoch_size == MIN_EPOCH_REQUESTS


async def test_a_non_streamed_answer_counts_its_whole_time_as_ttft_and_judges_only_that() -> None:
    state = DeploymentSlo(SloConfig(tpot_ms=10), seed=2)
    await one_epoch(state, ttft_s=5.0)  # no TPOT samples: a tpot-only SLO has nothing to break
    assert state.limit == 3
    assert state.state()["ttft_p50_ms"] == 5000.0 and state.state()["tpot_p50_ms"] is None


# -- the queue ------------------------------------------------------------------------------------------------


async def test_a_request_that_cannot_start_by_its_deadline_is_shed_with_retry_after() -> None:
    state = DeploymentSlo(slo(max_wait_ms=20), seed=1)
    ticket = await state.admit(A)
    with pytest.raises(OverloadedError) as caught:
        await state.admit(B)
    error = caught.value
    assert (error.status_code, error.code, error.type) == (503, "overloaded", "service_unavailable")
    assert error.headers["retry-after"] == "1"
    assert state.num_queued == 0 and state.num_shed == 1
    state.release(ticket, 0.01)
    assert state.num_admitted == 0


async def test_a_full_queue_sheds_at_once() -> None:
    state = DeploymentSlo(slo(max_queue=1, max_wait_ms=60_000), seed=1)
    await state.admit(A)
    waiting = asyncio.create_task(state.admit(A))
    await asyncio.sleep(0)
    assert state.num_queued == 1
    with pytest.raises(OverloadedError, match="queue is full"):
        await state.admit(B)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert state.num_queued == 0


async def test_freed_places_go_to_waiters_in_the_tenants_fair_order() -> None:
    state = DeploymentSlo(slo(max_wait_ms=60_000), seed=1)
    held = await state.admit(A)
    order: list[str] = []

    async def wait(label: str, who: Who) -> None:
        ticket = await state.admit(who)
        order.append(label)
        state.release(ticket, 0.01)

    tasks = [asyncio.create_task(wait(f"a{i}", A)) for i in range(3)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(wait("b0", B)))
    await asyncio.sleep(0)
    assert state.num_queued == 4
    state.release(held, 0.01)
    await asyncio.gather(*tasks)
    assert order == ["a0", "b0", "a1", "a2"]
    assert state.num_admitted == 0


async def test_a_newcomer_does_not_overtake_a_waiter() -> None:
    state = DeploymentSlo(slo(max_wait_ms=60_000), seed=1)
    held = await state.admit(A)
    waiter = asyncio.create_task(state.admit(B))
    await asyncio.sleep(0)
    state.release(held, 0.01)  # handed to the waiter at once
    assert not state.has_room and state.num_admitted == 1
    state.release(await waiter, 0.01)


async def test_a_waiter_that_leaves_gives_its_place_back() -> None:
    state = DeploymentSlo(slo(max_wait_ms=60_000), seed=1)
    held = await state.admit(A)
    waiter = asyncio.create_task(state.admit(B))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert state.num_queued == 0
    state.release(held, 0.01)
    assert state.num_admitted == 0 and state.has_room


def test_the_deadline_defaults_to_half_the_ttft_target() -> None:
    assert SloConfig(ttft_ms=800).max_wait_s == 0.4
    assert SloConfig(tpot_ms=30).max_wait_s == 1.0
    assert SloConfig(ttft_ms=800, max_wait_ms=50).max_wait_s == 0.05


# -- picking, streams -----------------------------------------------------------------------------------------


@dataclass
class FakeDeployment:
    name: str
    slo: DeploymentSlo | None


async def test_the_pick_prefers_room_then_the_shortest_queue_per_unit_of_limit() -> None:
    one, four = DeploymentSlo(slo(), seed=1), DeploymentSlo(slo(), seed=4)
    deployments = [FakeDeployment("one", one), FakeDeployment("four", four)]
    assert with_room(deployments) == deployments
    await one.admit(A)
    assert with_room(deployments) == [deployments[1]]
    await fill(four, 4)
    assert with_room(deployments) == [deployments[1]]  # both full, one request per place each: by name
    waiter = asyncio.create_task(four.admit(A))
    await asyncio.sleep(0)
    assert with_room(deployments) == [deployments[0]]  # 5 per 4 places against 1 per 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_timed_stream_measures_tpot_from_the_usage_chunk() -> None:
    async def chunks() -> Any:
        for _ in range(3):
            await asyncio.sleep(0.001)
            yield {"choices": [{"delta": {"content": "x"}}]}
        yield {"choices": [], "usage": {"completion_tokens": 7}}

    timed = TimedStream(chunks(), first_at=time.perf_counter())
    async for _ in timed:
        pass
    tpot = timed.tpot_s()
    assert tpot is not None and tpot == pytest.approx((timed.last_at - timed.first_at) / 6)
    assert timed.num_chunks == 4 and timed.usage_so_far() is None


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0


# -- the routing file -----------------------------------------------------------------------------------------


def routing(tmp_path: Path, model: dict[str, Any]) -> dict[str, Any]:
    deployments = [
        {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "name": f"d{i}", **extra}
        for i, extra in enumerate(model.pop("extras", [{}, {}]))
    ]
    return {"models": [{"id": "m", "deployments": deployments, **model}]}


def bench_run(tmp_path: Path, value: Any) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"schema_version": 1, "slo_result": {"max_concurrency_meeting_slo": value}}))
    return str(path)


def test_a_bench_run_seeds_every_deployment_and_max_concurrency_overrides_it(tmp_path: Path) -> None:
    seed = bench_run(tmp_path, 16)
    config = parse_routing(
        routing(tmp_path, {"slo": {"ttft_ms": 500}, "slo_seed": seed, "extras": [{}, {"max_concurrency": 3}]}),
        source="t",
    )
    router = Router(config, {"d0": object(), "d1": object()})  # type: ignore[dict-item]
    route = router.routes[0]
    assert route.has_slo
    limits = [d.slo.limit for d in route.deployments if d.slo is not None]
    assert limits == [16, 3]
    assert [row[1] for row in slo_states(router.routes)] == ["d0", "d1"]


def test_a_relative_slo_seed_is_read_next_to_the_routing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "knee.json").write_text(json.dumps({"slo_result": {"max_concurrency_meeting_slo": 12}}))
    document = routing(tmp_path, {"slo": {"tpot_ms": 50}, "slo_seed": "runs/knee.json"})
    path = tmp_path / "unigate.yaml"
    path.write_text(yaml.safe_dump(document))
    monkeypatch.chdir("/")
    assert load_routing(path).models[0].seed_concurrency == 12


def test_a_seed_above_the_ceiling_starts_at_the_ceiling(tmp_path: Path) -> None:
    config = parse_routing(
        routing(tmp_path, {"slo": {"ttft_ms": 500, "max_limit": 8}, "slo_seed": bench_run(tmp_path, 64)}), source="t"
    )
    router = Router(config, {"d0": object(), "d1": object()})  # type: ignore[dict-item]
    assert [d.slo.limit for d in router.routes[0].deployments if d.slo is not None] == [8, 8]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"slo": {}}, "needs `ttft_ms` and/or `tpot_ms`"),
        ({"slo_seed": "run.json"}, "need the model's `slo`"),
        ({"extras": [{"max_concurrency": 2}]}, "need the model's `slo`"),
        ({"slo": {"ttft_ms": 1}, "slo_seed": "/nonexistent/run.json"}, "cannot read `slo_seed`"),
        ({"slo": {"ttft_ms": 1}, "slo_seed": None, "extras": [{"max_concurrency": 0}]}, "max_concurrency"),
    ],
)
def test_slo_keys_that_cannot_work_are_refused(tmp_path: Path, model: dict[str, Any], message: str) -> None:
    with pytest.raises(RoutingConfigError, match=message):
        parse_routing(routing(tmp_path, model), source="t")


def test_a_run_that_met_the_slo_at_no_level_is_no_seed(tmp_path: Path) -> None:
    with pytest.raises(RoutingConfigError, match="has no `slo_result"):
        parse_routing(routing(tmp_path, {"slo": {"ttft_ms": 1}, "slo_seed": bench_run(tmp_path, None)}), source="t")


def test_a_model_without_slo_has_no_admission_state(tmp_path: Path) -> None:
    config = parse_routing(routing(tmp_path, {}), source="t")
    router = Router(config, {"d0": object(), "d1": object()})  # type: ignore[dict-item]
    route = router.routes[0]
    assert not route.has_slo and all(d.slo is None for d in route.deployments)
    assert list(slo_states(router.routes)) == []
    assert route.config.model_dump()["slo"] is None
