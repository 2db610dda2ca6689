"""The scheduler's fair share between tenants (local_engine/fair_share.py), over the fake paged model of
test_scheduler.py: a burst does not hold another tenant back, weights split the served tokens, a hypothesis run
against a small reference model of the counters, and outputs that never depend on who shares the batch."""

from __future__ import annotations

from collections import Counter

import pytest
from fakes.tiny_models import TinyModel
from hypothesis import given, settings
from hypothesis import strategies as st

from local_engine.block_manager import BlockManager
from local_engine.fair_share import FairShare, Priority, Tenancy
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import Scheduler
from local_engine.sequence import Sequence, SequenceStatus
from tests.local_engine.test_scheduler import EOS, FakeModel


def make_seq(scheduler: Scheduler, name: str, prompt: list[int], max_tokens: int, tenancy: Tenancy) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seq = Sequence(name, prompt, params, max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), tenancy=tenancy)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, model: FakeModel) -> list[Sequence]:
    batch = scheduler.schedule()
    scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
    return batch.seqs


def test_an_idle_tenant_starts_at_the_lowest_active_counter_and_banks_nothing() -> None:
    fair = FairShare()
    fair.join("a")
    fair.charge(Tenancy("a"), 500)
    fair.join("b")
    assert fair.counters == {"a": 500.0, "b": 500.0}
    fair.charge(Tenancy("b", weight=2.0), 100)
    assert fair.counters["b"] == 550.0 and fair.served_tokens["b"] == 100
    fair.leave("b")
    assert "b" not in fair.counters and fair.served_tokens["b"] == 100


def test_preemption_needs_another_tenant_a_gap_or_a_better_class() -> None:
    fair = FairShare()
    for tenant in ("a", "b"):
        fair.join(tenant)
    fair.charge(Tenancy("a"), 100)
    assert fair.may_preempt(Tenancy("b"), Tenancy("a"), gap=100)
    assert not fair.may_preempt(Tenancy("b"), Tenancy("a"), gap=101)
    assert not fair.may_preempt(Tenancy("a"), Tenancy("a", priority="low"), gap=0)
    assert fair.may_preempt(Tenancy("a", priority="high"), Tenancy("b"), gap=10**6)
    assert not fair.may_preempt(Tenancy("b", priority="low"), Tenancy("a"), gap=0)
    with pytest.raises(ValueError):
        Tenancy("a", weight=0)


def test_a_burst_does_not_hold_another_tenant_back() -> None:
    """A floods the engine with 200 sequences; B's one request is admitted within a few steps, not after A's."""
    bm = BlockManager(400, 4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=1000)
    model = FakeModel(400, 4)
    for i in range(200):
        make_seq(scheduler, f"a{i}", [5 + i % 7] * 6, 64, Tenancy("A"))
    for _ in range(10):
        step(scheduler, model)
    b = make_seq(scheduler, "b", [9, 8, 7], 4, Tenancy("B"))
    num_steps = 0
    while b.status is SequenceStatus.WAITING:
        step(scheduler, model)
        num_steps += 1
    # B starts level with A and has nothing running: it takes one of A's seats at once.
    assert num_steps == 1  # first come, first served: after ~190 of A's sequences, 1500+ steps
    assert scheduler.fair.preemptions["A"] >= 1
    while not b.is_finished:
        step(scheduler, model)
    assert len(b.output_token_ids) == 4


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_weights_split_the_served_tokens(weights: tuple[float, float]) -> None:
    bm = BlockManager(2000, 4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=1000)
    model = FakeModel(2000, 4)
    for i in range(60):
        for tenant, weight in zip("AB", weights, strict=True):
            make_seq(scheduler, f"{tenant}{i}", [5 + i % 11] * 8, 48, Tenancy(tenant, weight=weight))
    for _ in range(50):  # past the start, when both are served their first prompts
        step(scheduler, model)
    before = Counter(scheduler.fair.served_tokens)
    for _ in range(400):
        step(scheduler, model)
    served = Counter(scheduler.fair.served_tokens)
    served.subtract(before)
    assert served["A"] / served["B"] == pytest.approx(weights[0] / weights[1], rel=0.1)


class ReferenceCounters:
    """The fair-share rule written plainly: counters of active tenants, lifted on return, charged per token."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()

    def arrive(self, tenancy: Tenancy) -> None:
        if self.active[tenancy.tenant] == 0:
            self.counters[tenancy.tenant] = min(self.counters.values(), default=0.0)
        self.active[tenancy.tenant] += 1

    def finish(self, tenancy: Tenancy) -> None:
        self.active[tenancy.tenant] -= 1
        if self.active[tenancy.tenant] == 0:
            del self.counters[tenancy.tenant]


ARRIVAL = st.tuples(
    st.integers(0, 30),  # step of arrival
    st.integers(0, 2),  # tenant
    st.sampled_from(["normal", "normal", "high", "low"]),
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max tokens
)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(ARRIVAL, min_size=1, max_size=24),
    weights=st.tuples(st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 0.5]), st.just(1.0)),
    num_blocks=st.integers(12, 60),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(8, 40),
)
def test_the_scheduler_follows_the_reference_counters(
    arrivals: list[tuple[int, int, Priority, int, int]],
    weights: tuple[float, float, float],
    num_blocks: int,
    max_num_seqs: int,
    budget: int,
) -> None:
    """Counters match the reference; no sequence is admitted while one of a better (class, counter) waits through
    the whole step; every sequence finishes, with the output it has alone; one tenant is served in arrival order."""
    bm = BlockManager(num_blocks, 4)
    scheduler = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1000)
    model = FakeModel(num_blocks, 4)
    reference = ReferenceCounters()
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    seqs: list[tuple[Sequence, list[int], int]] = []
    is_one_tenancy = len({(a[1], a[2]) for a in arrivals}) == 1
    for num_steps in range(5000):
        while pending and pending[0][1][0] <= num_steps:
            i, (_, tenant, priority, length, max_tokens) = pending.pop(0)
            tenancy = Tenancy(str(tenant), weight=weights[tenant], priority=priority)
            prompt = [(i * 13 + j) % 50 + 5 for j in range(length)]
            reference.arrive(tenancy)
            seqs.append((make_seq(scheduler, str(i), prompt, max_tokens, tenancy), prompt, max_tokens))
        if not scheduler.has_unfinished:
            if not pending:
                break
            continue
        start = dict(reference.counters)
        waiting_before = {s for s in scheduler.waiting if not s.is_waiting_for_parent}
        batch = scheduler.schedule()
        assert not batch.is_empty, "nothing scheduled while requests wait"
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            reference.counters[seq.tenancy.tenant] += n / seq.tenancy.weight
        newly = [s for s in batch.seqs if s in waiting_before]
        still_waiting = [s for s in scheduler.waiting if s in waiting_before and not s.num_preemptions]
        for seq in newly:
            for other in still_waiting:
                if is_one_tenancy:
                    assert seq.seq_id < other.seq_id, "one tenant: first come, first served"
                if other.tenancy.tenant == seq.tenancy.tenant:
                    continue
                assert seq.tenancy.rank <= other.tenancy.rank, "a worse class overtook a better one"
                if seq.tenancy.rank == other.tenancy.rank:
                    assert start[seq.tenancy.tenant] <= reference.counters[other.tenancy.tenant] + 1e-6
        scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
        finished_now = [s for s in batch.seqs if s.is_finished]
        for seq in finished_now:
            reference.finish(seq.tenancy)
        for name, value in reference.counters.items():
            assert scheduler.fair.counters[name] == pytest.approx(value, abs=1e-6)
        assert set(scheduler.fair.counters) == set(reference.counters)
    assert not scheduler.has_unfinished and not pending, "a sequence starved"
    for seq, prompt, max_tokens in seqs:
        alone = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1000)
        solo = make_seq(alone, "solo", prompt, max_tokens, Tenancy())
        solo_model = FakeModel(64, 4)
        while alone.has_unfinished:
            step(alone, solo_model)
        assert seq.output_token_ids == solo.output_token_ids


def test_a_burst_through_the_engine_does_not_hold_another_tenant_back(llama: TinyModel) -> None:
    """Through LLMEngine with a tiny model: A floods, B's request is admitted at the next step and its greedy
    output is the one it has alone."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llama.engine()
    alone.add_request("b", [7, 8, 9], params)
    (solo,) = alone.requests["b"].seqs
    while alone.has_unfinished_requests:
        alone.step()
    engine = llama.engine(max_num_seqs=4)
    for i in range(40):
        engine.add_request(f"a{i}", [5 + i % 9] * 6, params, Tenancy("A"))
    for _ in range(3):
        engine.step()
    engine.add_request("b", [7, 8, 9], params, Tenancy("B"))
    engine.step()
    (b,) = engine.requests["b"].seqs
    assert b.status is not SequenceStatus.WAITING and engine.scheduler.fair.preemptions["A"] == 1
    assert engine.stats()["waiting_by_tenant"] == {"A": 37}
    while engine.has_unfinished_requests:
        engine.step()
    assert b.output_token_ids == solo.output_token_ids
