"""Block manager: growth one block at a time, immediate frees, prefix caching with refcounts and LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from local_engine.block_manager import BlockManager
from local_engine.sampling_params import SamplingParams
from local_engine.sequence import Sequence


def make_seq(tokens: list[int], n: int = 1) -> Sequence:
    return Sequence("r", tokens, SamplingParams(n=n), max_tokens=100)


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> list[int]:
    computed = bm.get_computed_blocks(seq)
    if num_new is None:
        num_new = seq.num_tokens - len(computed) * bm.block_size
    assert bm.can_allocate(seq, computed, num_new)
    bm.allocate(seq, computed, num_new)
    return computed


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    before = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq, before)


def test_table_grows_one_block_at_a_time_and_frees_immediately() -> None:
    bm = BlockManager(8, 4)
    seq = make_seq([1, 2, 3])
    admit(bm, seq)
    assert len(seq.block_table) == 1
    compute_all(bm, seq)
    for token in range(4, 10):
        seq.append_token(token)
        assert bm.can_append(seq, 1)
        bm.may_append(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-seq.num_tokens // 4)
    assert bm.num_used_blocks == 3
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hit_shares_blocks_with_refcounts() -> None:
    bm = BlockManager(16, 4)
    first = make_seq(list(range(10)))
    admit(bm, first)
    compute_all(bm, first)
    second = make_seq([*range(8), 99, 98, 97])
    computed = admit(bm, second)
    assert computed == first.block_table[:2]
    assert second.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in computed] == [2, 2]
    bm.check_invariants([first, second])
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in computed] == [1, 1]
    bm.free(second)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16
    assert bm.num_hit_tokens == 8


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    bm = BlockManager(16, 4)
    first = make_seq(list(range(8)))
    admit(bm, first)
    compute_all(bm, first)
    bm.free(first)
    again = make_seq(list(range(8)))
    assert len(admit(bm, again)) == 1  # the second block is recomputed so the last token produces logits


def test_freed_cached_blocks_are_reused_and_evicted_lru_only_when_needed() -> None:
    bm = BlockManager(4, 4)
    a = make_seq(list(range(9)))  # 3 blocks, 2 full
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached_block_ids) == 2
    b = make_seq([50, 51, 52])  # takes the unhashed block first: the cached ones survive
    admit(bm, b)
    assert len(bm.cached_block_ids) == 2
    c = make_seq([60, 61, 62, 63, 64, 65])  # needs 2 more: one cached block must go, the tail one first
    admit(bm, c)
    assert bm.num_evictions == 1
    assert len(bm.get_computed_blocks(make_seq(list(range(9))))) == 1


def test_different_content_with_same_tokens_in_block_does_not_hit() -> None:
    bm = BlockManager(16, 2)
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    # Block 1 holds [3, 4] in both, but under a different parent: chained hashes keep them apart.
    b = make_seq([9, 9, 3, 4, 5])
    assert bm.get_computed_blocks(b) == []


def test_no_cache_without_prefix_caching_except_for_siblings() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.get_computed_blocks(make_seq(list(range(10)))) == []
    parent = make_seq(list(range(100, 110)), n=2)
    admit(bm, parent)
    compute_all(bm, parent)
    assert len(bm.get_computed_blocks(make_seq(list(range(100, 110)), n=2))) == 2


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "free"]), st.integers(0, 5), st.integers(1, 30)),
        max_size=60,
    ),
    prefix_caching=st.booleans(),
)
def test_property_refcounts_and_no_leaks(ops: list[tuple[str, int, int]], prefix_caching: bool) -> None:
    """Random admissions, growth and frees: refcounts always match the owners, shared blocks are always cached
    blocks, and every block returns to the pool once every sequence is gone."""
    bm = BlockManager(24, 4, enable_prefix_caching=prefix_caching)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 7, 7, 7, 7, 7, 7], [5] * 13, [1, 2, 3, 4]]
    live: list[Sequence] = []
    for op, pick, length in ops:
        if op == "add":
            seq = make_seq(prompts[pick % len(prompts)][: max(1, length)])
            computed = bm.get_computed_blocks(seq)
            num_new = seq.num_tokens - len(computed) * 4
            if bm.can_allocate(seq, computed, num_new):
                bm.allocate(seq, computed, num_new)
                compute_all(bm, seq)
                live.append(seq)
        elif op == "step" and live:
            seq = live[pick % len(live)]
            seq.append_token(length)
            if bm.can_append(seq, 1):
                bm.may_append(seq, 1)
                compute_all(bm, seq)
            else:
                bm.free(seq)  # preempted (or aborted): everything it held goes back
                live.remove(seq)
        elif op == "free" and live:
            bm.free(live.pop(pick % len(live)))
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
