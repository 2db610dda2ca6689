"""Scheduler over a fake model that stores token ids in a fake paged cache and 'samples' from what it reads back
through the block table: wrong block tables, bad prefix sharing or lossy preemption change the outputs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_engine.block_manager import BlockManager
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import PromptTooLongError, Scheduler
from local_engine.sequence import FinishReason, Sequence

EOS = 3


class FakeModel:
    """'KV' is the token id itself; the next token is a hash of the context read back from the cache."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.cache = [-1] * (num_blocks * block_size)
        self.block_size = block_size

    def run(self, seqs: list[Sequence], num_new: list[int]) -> list[int]:
        size = self.block_size
        sampled = []
        for seq, n in zip(seqs, num_new, strict=True):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.cache[seq.block_table[pos // size] * size + pos % size] = seq.token_ids[pos]
            end = seq.num_computed_tokens + n
            if end == seq.num_tokens:
                context = [self.cache[seq.block_table[p // size] * size + p % size] for p in range(end)]
                assert context == seq.token_ids, "the cache does not hold this sequence's tokens"
                sampled.append((sum(t * (i + 1) for i, t in enumerate(context)) * 7919) % 61 + 3)
        return sampled


def run_all(
    prompts: list[list[int]],
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefix_caching: bool = True,
    max_tokens: int = 12,
    abort_at: dict[int, int] | None = None,
) -> tuple[dict[int, list[int]], Scheduler]:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(
        bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=1000
    )
    model = FakeModel(num_blocks, block_size)
    seqs = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens)
        seq = Sequence(
            str(i),
            prompt,
            params,
            max_tokens=scheduler.resolve_max_tokens(len(prompt), max_tokens),
            eos_token_ids=frozenset({EOS}),
        )
        seqs.append(seq)
        scheduler.add(seq)
    num_steps = 0
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        assert not batch.is_empty, "nothing scheduled while requests wait: deadlock"
        assert batch.num_batched_tokens <= max_num_batched_tokens
        assert len(scheduler.running) <= max_num_seqs
        assert all(n == 1 for n in batch.num_new_tokens[: batch.num_decode_seqs])
        scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
        num_steps += 1
        for index, step in (abort_at or {}).items():
            if step == num_steps:
                scheduler.finish(seqs[index], FinishReason.ABORT)
        bm.check_invariants(scheduler.running)
        assert num_steps < 10_000
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
    return {i: s.output_token_ids for i, s in enumerate(seqs)}, scheduler


PROMPTS = [[(i * 7 + j) % 50 + 5 for j in range(length)] for i, length in enumerate([5, 17, 3, 30, 9, 22, 1, 16])]


def test_outputs_do_not_depend_on_memory_budget_or_chunking() -> None:
    reference, _ = run_all(PROMPTS, num_blocks=200, max_num_batched_tokens=512)
    squeezed, scheduler = run_all(PROMPTS, num_blocks=12, max_num_batched_tokens=8)
    assert scheduler.num_preemptions > 0
    assert squeezed == reference


def test_preempts_the_most_recent_arrival() -> None:
    bm = BlockManager(4, 4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    a = Sequence("a", [1] * 8, SamplingParams(), max_tokens=8)
    b = Sequence("b", [2] * 8, SamplingParams(), max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    model = FakeModel(4, 4)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
    assert a.num_tokens == 9 and b.num_tokens == 9
    batch = scheduler.schedule()  # both need a third block; only 0 free: b (later) is preempted for a
    assert batch.preempted == [b] and batch.seqs == [a]
    assert list(scheduler.waiting) == [b] and b.num_computed_tokens == 0 and b.num_tokens == 9


def test_long_prompt_is_chunked_while_others_keep_decoding() -> None:
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=6, max_model_len=1000)
    short = Sequence("s", [1, 2], SamplingParams(), max_tokens=20)
    scheduler.add(short)
    model = FakeModel(64, 4)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
    long = Sequence("l", list(range(5, 45)), SamplingParams(), max_tokens=20)
    scheduler.add(long)
    for _ in range(5):
        batch = scheduler.schedule()
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1
        assert batch.seqs[1] is long and batch.num_new_tokens[1] == 5
        scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
    assert long.num_computed_tokens == 25 and long.num_output_tokens == 0


def test_prefix_cache_hits_skip_compute() -> None:
    shared = list(range(10, 42))
    prompts = [[*shared, 1, 2], [*shared, 5]]
    _, scheduler = run_all(prompts, num_blocks=100, max_num_seqs=1)
    assert scheduler.block_manager.num_hit_tokens == 32


def test_n_siblings_wait_for_the_parent_then_share_its_prompt() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1000)
    params = SamplingParams(n=3, max_tokens=4)
    parent = Sequence("r", list(range(10, 30)), params, max_tokens=4)
    children = [Sequence("r", parent.prompt_token_ids, params, max_tokens=4, index=i, parent=parent) for i in (1, 2)]
    for seq in (parent, *children):
        scheduler.add(seq)
    model = FakeModel(64, 4)
    batch = scheduler.schedule()
    assert batch.seqs == [parent]
    scheduler.postprocess(batch, model.run(batch.seqs, batch.num_new_tokens))
    batch = scheduler.schedule()
    assert set(batch.seqs) == {parent, *children}
    assert all(c.num_cached_tokens == 16 for c in children)
    assert all(c.block_table[:4] == parent.block_table[:4] for c in children)


def test_rejects_what_can_never_fit() -> None:
    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    assert scheduler.max_model_len == 16
    assert scheduler.resolve_max_tokens(10, None) == 6
    with pytest.raises(PromptTooLongError, match="maximum context length is 16"):
        scheduler.resolve_max_tokens(10, 7)
    with pytest.raises(PromptTooLongError):
        scheduler.resolve_max_tokens(16, None)


def test_aborts_free_everything() -> None:
    outputs, _ = run_all(PROMPTS, num_blocks=14, max_num_batched_tokens=8, abort_at={1: 2, 3: 5, 0: 40})
    assert len(outputs[3]) < 12


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    num_blocks=st.integers(14, 40),
    budget=st.integers(8, 40),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 100),
)
def test_property_outputs_invariant_under_pressure(
    lengths: list[int], num_blocks: int, budget: int, max_num_seqs: int, prefix_caching: bool, seed: int
) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 60) for _ in range(12)]
    prompts = [(shared + [rng.randrange(5, 60) for _ in range(n)])[: max(n, 1)] for n in lengths]
    reference, _ = run_all(prompts, num_blocks=400, max_num_batched_tokens=512, max_num_seqs=8)
    outputs, _ = run_all(
        prompts,
        num_blocks=num_blocks,
        max_num_batched_tokens=max(budget, max_num_seqs),
        max_num_seqs=max_num_seqs,
        prefix_caching=prefix_caching,
    )
    assert outputs == reference
