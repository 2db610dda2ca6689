"""Iteration-level scheduling: which sequences compute how many tokens in the next step.

Every step mixes decode tokens of running sequences with (chunked) prefill of new ones under
`max_num_batched_tokens` and `max_num_seqs`, in this order: running decodes, running prefills (the next chunk of a
long prompt), then waiting sequences by their tenant's fair share (local_engine/fair_share.py: priority class, then
virtual token counter, then arrival). When the cache runs out of blocks the latest running sequence of the most
served tenant is preempted by recompute: its blocks are freed and it goes back to the front of the queue with its
generated tokens kept, so it later resumes with exactly the output it would have produced. A waiting sequence of a
less served tenant (by `fair_preempt_gap` tokens) or a better priority class takes a full batch's or cache's room
the same way. One tenant alone: first come, first served, exactly.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from local_engine.block_manager import BlockManager
from local_engine.errors import PromptTooLongError
from local_engine.fair_share import FairShare
from local_engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["PromptTooLongError", "ScheduledBatch", "Scheduler"]


@dataclass
class ScheduledBatch:
    """One step's work. `seqs[i]` computes its next `num_new_tokens[i]` tokens; decodes come first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode_seqs: int = 0  # seqs[:num_decode_seqs] compute exactly one token with KV already cached
    # the next num_verify_seqs verify proposed tokens: their last token and `spec_token_ids`, KV cached before them
    num_verify_seqs: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def sampling_mask(self) -> list[bool]:
        """Which sequences reach their last known token (and proposed tokens) this step, and so sample."""
        return [
            s.num_computed_tokens + n == s.num_tokens + len(s.spec_token_ids)
            for s, n in zip(self.seqs, self.num_new_tokens, strict=True)
        ]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        fair_preempt_gap: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A sequence longer than the whole cache could never run, even alone.
        self.max_model_len = min(max_model_len, block_manager.num_blocks * block_manager.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by seq_id, i.e. by arrival
        self.num_preemptions = 0
        self.fair = FairShare()
        self.is_fair = True  # False: first come, first served across tenants (benchmarks/tenancy.py's baseline)
        # How far (weighted tokens) a running tenant must be ahead of a waiting one before it gives up a sequence:
        # one step of a full batch's decodes by default: a newcomer (which starts level with the most underserved
        # active tenant) waits about one step, and a tenant is not preempted back and forth every step.
        self.fair_preempt_gap = max_num_seqs if fair_preempt_gap is None else fair_preempt_gap

    # -- admission ----------------------------------------------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The number of tokens a request may generate, or PromptTooLongError if it can never fit."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                "tokens. Shorten the prompt (it must leave room for at least one generated token)."
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                "completion). Reduce the prompt or max_tokens."
            )
        return max_tokens

    def add(self, seq: Sequence) -> None:
        self.fair.join(seq.tenancy.tenant, seq.tenancy.weight)
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -----------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        block_size = self.block_manager.block_size
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            (decodes if len(seq.token_ids) - seq.num_computed_tokens == 1 else prefills).append(seq)
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                break
            if seq.spec_token_ids:
                num_new += self._fit_proposal(seq, budget)
            if num_new == 1 and seq.num_computed_tokens % block_size:
                # the token goes into the last block, which has room: nothing to allocate
                budget -= self._take(scheduled, seq, 1)
                continue
            while not self.block_manager.can_append(seq, num_new):
                victim = max(self.running, key=self._victim_key)
                budget += self._preempt(victim, scheduled, preempted)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq, num_new)
                budget -= self._take(scheduled, seq, num_new)
        if not preempted:
            budget = self._admit_waiting(scheduled, budget, preempted)
        # Decodes first, longest context first (attention groups sequences of similar length), then prefills.
        # Verifications next: the model runner computes them as decode rows, one per query position.
        decode_seqs: list[Sequence] = []
        verify_seqs: list[Sequence] = []
        verify_new: list[int] = []
        prefill_seqs: list[Sequence] = []
        prefill_new: list[int] = []
        for seq, n in scheduled.items():
            if n == 1 and len(seq.token_ids) - seq.num_computed_tokens == 1:
                decode_seqs.append(seq)
            elif seq.spec_token_ids:
                verify_seqs.append(seq)
                verify_new.append(n)
            else:
                prefill_seqs.append(seq)
                prefill_new.append(n)
        decode_seqs.sort(key=lambda s: -len(s.token_ids))
        return ScheduledBatch(
            seqs=decode_seqs + verify_seqs + prefill_seqs,
            num_new_tokens=[1] * len(decode_seqs) + verify_new + prefill_new,
            num_decode_seqs=len(decode_seqs),
            num_verify_seqs=len(verify_seqs),
            preempted=preempted,
        )

    def _fit_proposal(self, seq: Sequence, budget: int) -> int:
        """Trim a decode's proposed tokens to the budget left after its own token and to the free blocks (short
        of blocks, it decodes normally rather than preempt anyone); returns how many stay."""
        del seq.spec_token_ids[budget - 1 :]
        if seq.spec_token_ids and not self.block_manager.can_append(seq, 1 + len(seq.spec_token_ids)):
            seq.spec_token_ids = []
        return len(seq.spec_token_ids)

    def _admit_waiting(self, scheduled: dict[Sequence, int], budget: int, preempted: list[Sequence]) -> int:
        """Move waiting sequences into the running set, the most underserved tenant's first, while budget, seats
        and blocks allow, taking a more served tenant's room when `_fair_victim` allows it."""
        size = self.block_manager.block_size
        admitted: set[Sequence] = set()  # never preempted in the step that admits them: no cycles
        while budget > 0 and (index := self._next_waiting()) is not None:
            seq = self.waiting[index]
            if len(self.running) >= self.max_num_seqs:
                fits = False
            else:
                computed = self.block_manager.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - len(computed) * size, budget)
                fits = self.block_manager.can_allocate(seq, computed, num_new)
            if not fits:
                victim = self._fair_victim(seq, admitted)
                if victim is None:
                    break  # nobody overtakes the sequence whose turn it is
                budget += self._preempt(victim, scheduled, preempted)
                continue
            del self.waiting[index]
            if not seq.num_preemptions and not seq.num_computed_tokens:
                self.fair.queue_time_s[seq.tenancy.tenant] += time.monotonic() - seq.arrival_time
                seq.scheduled_ns = time.time_ns()
            self.block_manager.allocate(seq, computed, num_new)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            admitted.add(seq)
            budget -= self._take(scheduled, seq, num_new)
        return budget

    def _next_waiting(self) -> int | None:
        """The index of the waiting sequence to admit next: lowest (priority, tenant counter), then arrival order
        (the queue's; preempted sequences return to its front). Siblings wait for their parent's prompt."""
        best: int | None = None
        best_key = (0, 0.0)
        key = self.fair.key
        for i, seq in enumerate(self.waiting):
            if seq.is_waiting_for_parent:
                continue
            if not self.is_fair:
                return i
            seq_key = key(seq.tenancy)
            if best is None or seq_key < best_key:
                best, best_key = i, seq_key
        return best

    def _victim_key(self, seq: Sequence) -> tuple[int, float, int]:
        """Preempted first: the worst priority class, the most served tenant, its latest sequence."""
        rank, counter = self.fair.key(seq.tenancy)
        return rank, counter, seq.seq_id

    def _fair_victim(self, seq: Sequence, admitted: set[Sequence]) -> Sequence | None:
        """The running sequence `seq` may take the room of, if any (see FairShare.may_preempt)."""
        if len(self.fair.num_active) < 2 or not self.is_fair:
            return None  # one tenant: first come, first served
        victim = max((s for s in self.running if s not in admitted), key=self._victim_key, default=None)
        if victim is None:
            return None
        # A tenant with nothing running takes its first seat without waiting for a gap: that cannot go back and
        # forth (each such preemption seats a tenant that had none).
        tenant = seq.tenancy.tenant
        gap = self.fair_preempt_gap if any(s.tenancy.tenant == tenant for s in self.running) else 0
        return victim if self.fair.may_preempt(seq.tenancy, victim.tenancy, gap) else None

    def _take(self, scheduled: dict[Sequence, int], seq: Sequence, num_new: int) -> int:
        scheduled[seq] = num_new
        self.fair.charge(seq.tenancy, num_new)
        return num_new

    def _preempt(self, seq: Sequence, scheduled: dict[Sequence, int], preempted: list[Sequence]) -> int:
        """Preempt `seq` by recompute; returns the budget it had taken this step (refunded to its tenant)."""
        seq.spec_token_ids = []
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.fair.preemptions[seq.tenancy.tenant] += 1
        self.waiting.appendleft(seq)
        preempted.append(seq)
        num_taken = scheduled.pop(seq, 0)
        if num_taken:
            self.fair.charge(seq.tenancy, -num_taken)
        return num_taken

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: list[int],
        accepted_token_ids: list[list[int]] | None = None,
    ) -> list[Sequence]:
        """Record the computed tokens and append each sampling sequence's new token (in batch order).
        `accepted_token_ids` (speculative steps): per sampling sequence, its accepted proposed tokens, which come
        before its sampled token. Returns the sequences that received tokens; finished ones are already freed."""
        updated: list[Sequence] = []
        tokens = iter(sampled_token_ids)
        accepted = iter(accepted_token_ids) if accepted_token_ids is not None else None
        size = self.block_manager.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        max_model_len = self.max_model_len
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.spec_token_ids:
                assert accepted is not None, "a speculative step needs the accepted tokens"
                self._append_verified(seq, [*next(accepted), next(tokens)])
                updated.append(seq)
                continue
            if accepted is not None and seq.num_computed_tokens + num_new == len(seq.token_ids):
                next(accepted)  # a sequence without a proposal in a speculative step
            before = seq.num_computed_tokens
            seq.num_computed_tokens = computed = before + num_new
            if computed // size != before // size:  # a block became full
                cache_full_blocks(seq, before)
            if computed < len(seq.token_ids):
                continue  # a prefill chunk that does not reach the end of the prompt yet
            seq.token_ids.append(next(tokens))
            updated.append(seq)
            if seq.check_stop(max_model_len):
                self.finish(seq, seq.finish_reason or FinishReason.STOP)
        return updated

    def _append_verified(self, seq: Sequence, new_token_ids: list[int]) -> None:
        """Append a verified sequence's accepted tokens and the target's token, up to a stop condition; its KV is
        then valid up to (not including) its last token: the blocks past that are freed (the rejected tail)."""
        seq.spec_token_ids = []
        before = seq.num_computed_tokens
        is_stopped = False
        for token_id in new_token_ids:
            seq.token_ids.append(token_id)
            if seq.check_stop(self.max_model_len):
                is_stopped = True
                break
        seq.num_computed_tokens = computed = len(seq.token_ids) - 1
        self.block_manager.truncate(seq)
        size = self.block_manager.block_size
        if computed // size != before // size:
            self.block_manager.cache_full_blocks(seq, before)
        if is_stopped:
            self.finish(seq, seq.finish_reason or FinishReason.STOP)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` now (stop condition, stop string or abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.fair.leave(seq.tenancy.tenant)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
