"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, automatic prefix caching.

A sequence's block table grows one block at a time as its tokens are computed and shrinks to nothing when it
finishes or is preempted. Full blocks whose KV is computed get a content hash chained over the whole prefix
(`hash((parent_hash, tokens))`), so a later sequence with the same prefix reuses them with a reference count
instead of recomputing. A block whose count drops to zero returns to the free pool at once but keeps its hash:
it is only evicted (least recently freed first) when a fresh block is needed and no unhashed one is left.
"""

from __future__ import annotations

from collections import OrderedDict

from local_engine.sequence import Sequence

__all__ = ["Block", "BlockManager"]


class Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        # Kept to confirm a hash hit really is the same content (Python's 64-bit hash can collide).
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        self.ref_count = 0
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: unhashed ones at the front (worthless, used first), hashed ones in the
        # order they were freed (least recently used first).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    # -- capacity ---------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing ----------------------------------------------------------------------------------------------

    def _uses_cache(self, seq: Sequence) -> bool:
        # `n` > 1 siblings share their parent's prompt through the cache even when prefix caching is off.
        return self.enable_prefix_caching or seq.params.n > 1

    def _block_hash(self, seq: Sequence, index: int) -> int:
        """The chained hash of full block `index` of `seq`, memoised on the sequence (tokens never change)."""
        hashes = seq.block_hashes
        size = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[i - 1] if i else None
            hashes.append(hash((parent, tuple(seq.token_ids[i * size : (i + 1) * size]))))
        return hashes[index]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (for a sequence about to be admitted). At least one token is
        always left to compute, because the step that computes the last token is the one that samples."""
        if not self._uses_cache(seq):
            return []
        size = self.block_size
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // size):
            block_hash = self._block_hash(seq, i)
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = seq.block_hashes[i - 1] if i else None
            if block.parent_hash != parent or block.token_ids != tuple(seq.token_ids[i * size : (i + 1) * size]):
                break
            hits.append(block_id)
        return hits

    # -- allocation ---------------------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, computed_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether `seq` (no blocks yet) can take `computed_blocks` plus room for `num_new_tokens` more tokens."""
        num_cached_tokens = len(computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_cached_tokens + num_new_tokens) - len(computed_blocks)
        # Reviving a cached block that sits in the free pool takes it out of the pool too.
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return self.num_free_blocks - num_revived >= num_required

    def allocate(self, seq: Sequence, computed_blocks: list[int], num_new_tokens: int) -> None:
        assert not seq.block_table, f"{seq} already has blocks"
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        num_cached_tokens = len(computed_blocks) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached_tokens
        if self._uses_cache(seq):
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += num_cached_tokens
        self.may_append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the blocks for `num_new_tokens` more computed tokens of a running `seq` are available."""
        num_required = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return num_required <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens (no-op while the last block has room)."""
        num_required = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(num_required):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_block_ids.get(block.block_hash) == block_id:
                del self.cached_block_ids[block.block_hash]
            self.num_evictions += 1
        block.reset()
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Register the blocks of `seq` that became full and computed since `num_computed_before`."""
        if not self._uses_cache(seq):
            return
        size = self.block_size
        for i in range(num_computed_before // size, seq.num_computed_tokens // size):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue  # a prefix-cache hit, already registered
            block_hash = self._block_hash(seq, i)
            if block_hash in self.cached_block_ids:
                continue  # computed twice in the same step by two sequences; the first copy is the cached one
            block.block_hash = block_hash
            block.parent_hash = seq.block_hashes[i - 1] if i else None
            block.token_ids = tuple(seq.token_ids[i * size : (i + 1) * size])
            self.cached_block_ids[block_hash] = block.block_id

    def truncate(self, seq: Sequence) -> None:
        """Free the blocks of `seq` past its computed tokens (those allocated for rejected proposed tokens).
        They hold no computed full block, so none has a hash: they go to the front of the free pool."""
        num_kept = self.num_blocks_for(seq.num_computed_tokens)
        for block_id in seq.block_table[num_kept:]:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"block {block_id} is shared or cached"
            self.free_block_ids[block_id] = None
            self.free_block_ids.move_to_end(block_id, last=False)
        del seq.block_table[num_kept:]

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks at once. Tail blocks are freed first, so they are evicted before the prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                if block.block_hash is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_block_ids:
            self.blocks[block_id].reset()
        self.cached_block_ids = {
            block_hash: b for block_hash, b in self.cached_block_ids.items() if self.blocks[b].ref_count
        }

    def check_invariants(self, live_seqs: list[Sequence]) -> None:
        """Assert the bookkeeping is consistent with the live sequences' block tables (used by tests)."""
        owners = [0] * self.num_blocks
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} lists a block twice"
            for block_id in seq.block_table:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], f"block {block.block_id} refcount mismatch"
            assert (block.ref_count == 0) == (block.block_id in self.free_block_ids), "free pool mismatch"
            if owners[block.block_id] > 1:
                assert block.block_hash is not None, f"block {block.block_id} shared without being cached"
        for block_hash, block_id in self.cached_block_ids.items():
            assert self.blocks[block_id].block_hash == block_hash, "hash map points at a reused block"
