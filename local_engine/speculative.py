"""Speculative decoding: a cheap proposer guesses a sequence's next tokens, one target forward pass scores them all.

Each step, before scheduling, `Speculator.propose` sets `seq.spec_token_ids` on the running sequences that
decode, from one batched call of the proposer: `NgramProposer` (prompt lookup) or `DraftProposer` (a draft model,
`local_engine/draft.py`). The scheduler gives such a sequence `1 + len(spec_token_ids)` query positions (an
"extend", like a chunk of prefill), the model runner returns the logits of every one of them, and `Sampler.verify`
accepts the proposed tokens while the token the target picks at that position (its argmax, or a sample of its
processed distribution) equals the proposal, then appends the target's own token there, so every step yields at
least one token and the output is exactly what decoding without speculation would produce (greedy) or is
distributed exactly like it (sampling: for a deterministic proposal, rejection sampling reduces to
accept-if-sampled; a draft's sampled proposal comes with its distribution q and is verified by rejection sampling
proper). `Scheduler.postprocess` appends the accepted tokens and rolls the KV back over the rejected ones (the
block manager frees the blocks past the last computed token; only full, computed blocks get a prefix-cache hash);
`Speculator.record` lets the proposer roll its own state back the same way.

Proposal lengths: prompt lookup proposes at most 1.5 times the length of the suffix it matched (up to
`num_tokens`); a draft's lengths adapt per sequence (`Speculator.record`): a fully accepted proposal lengthens the
next one by one (up to `num_tokens`), a partly accepted one shortens it to what was accepted plus one. With either,
after `MAX_MISSES` verifications in a row that accepted nothing the sequence stops proposing for `PAUSE_STEPS`
steps, then tries again (a draft with a single token). With more than `max_num_seqs` running sequences, no
sequence proposes (the step decodes normally and keeps the fused CPU decode path).

Requests that never speculate: those with presence, frequency or repetition penalties (the penalty at each
proposed position would depend on the proposals before it), and those still short of `min_tokens`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from local_engine.config import SpeculativeConfig
from local_engine.sequence import Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_MISSES", "PAUSE_STEPS", "NgramProposer", "Proposer", "Speculator", "build_speculator", "off_stats"]

MAX_MISSES = 3  # verifications in a row that accept nothing before a sequence pauses proposing
PAUSE_STEPS = 16  # steps a paused sequence decodes normally before it proposes again


class Proposer:
    """What the speculator asks of a proposer. A stateless one implements `propose` alone; one that keeps state
    per sequence (a draft model's KV cache) overrides the hooks, which do nothing here."""

    # True: the speculator adapts each sequence's proposal length to its acceptance; False: the proposer picks the
    # length itself, up to `num_tokens`. Either way a streak of misses pauses the sequence's proposals.
    adapts_length = True

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to `num_tokens` guesses of the tokens that follow `seq.token_ids` (none: decode normally)."""
        raise NotImplementedError

    def propose_batch(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """`propose` for every sequence of this step at once."""
        return [self.propose(seq, n) for seq, n in zip(seqs, num_tokens, strict=True)]

    def proposal_probs(self, seq: Sequence) -> torch.Tensor | None:
        """The distribution q [len(proposal), V] this step's proposal of `seq` was drawn from; None: deterministic."""
        return None

    def rollback(self, seq: Sequence) -> None:
        """After `seq`'s verification: drop what the proposer computed for its rejected proposals."""

    def forget(self, seq: Sequence) -> None:
        """`seq` finished, was aborted or was preempted: release what the proposer holds for it."""

    def reset(self) -> None:
        """The engine forgot every request (`LLMEngine.reset`)."""

    def stats(self) -> dict[str, float | int | str]:
        return {}


class NgramProposer(Proposer):
    """Prompt lookup: the earlier occurrence of the sequence's longest repeated suffix (at least `min_n` and at most
    `max_n` tokens; the most recent of equally long ones) in its prompt and output; proposes the tokens that
    followed it, up to `num_tokens` and at most 1.5 times the matched length (a short match is a weak guess, and
    every proposed token costs a row of the verifying step whether or not it is accepted). The length is its own
    choice: the speculator only pauses it after a streak of misses (`adapts_length`)."""

    adapts_length = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        tokens = seq.token_ids
        length = len(tokens)
        if length < 2 or num_tokens <= 0:
            return []
        ids = np.fromiter(tokens, dtype=np.int64, count=length)
        # Candidate ends of a match: every earlier position holding the last token; keep those whose match still
        # holds one token further back, while any does.
        ends = np.flatnonzero(ids[: length - 1] == ids[length - 1])
        if ends.size == 0:
            return []
        n = 1
        while n < self.max_n:
            longer = ends[ends >= n]
            longer = longer[ids[longer - n] == ids[length - 1 - n]]
            if longer.size == 0:
                break
            ends = longer
            n += 1
        if n < self.min_n:
            return []
        end = int(ends[-1])
        return tokens[end + 1 : end + 1 + min(num_tokens, max(1, n * 3 // 2))]


class Speculator:
    """Chooses who proposes how many tokens each step, records verification results, and keeps the totals."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verified_seqs = 0  # sequence-steps that verified a proposal

    def propose(self, running: list[Sequence], max_model_len: int) -> None:
        """Set this step's `spec_token_ids` on every running sequence (empty for those that decode normally)."""
        is_batch_small = len(running) <= self.config.max_num_seqs
        seqs: list[Sequence] = []
        lengths: list[int] = []
        for seq in running:
            seq.spec_token_ids = []
            num_tokens = self._proposal_length(seq, max_model_len) if is_batch_small else 0
            if num_tokens > 0:
                seqs.append(seq)
                lengths.append(num_tokens)
        if seqs:
            for seq, proposal in zip(seqs, self.proposer.propose_batch(seqs, lengths), strict=True):
                seq.spec_token_ids = proposal

    def _proposal_length(self, seq: Sequence, max_model_len: int) -> int:
        if len(seq.token_ids) - seq.num_computed_tokens != 1:
            return 0  # still prefilling
        params = seq.params
        if params.has_penalties or seq.num_output_tokens < params.min_tokens:
            return 0
        # The target's own token always follows the accepted ones: leave room for it.
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - len(seq.token_ids)) - 1
        if seq.num_spec_paused_steps:
            seq.num_spec_paused_steps -= 1
            return 0
        if not self.proposer.adapts_length:
            return min(self.config.num_tokens, room)
        if seq.num_spec_tokens < 0:
            seq.num_spec_tokens = self.config.num_tokens
        return min(seq.num_spec_tokens, room)

    def proposal_probs(self, seqs: list[Sequence]) -> list[torch.Tensor | None]:
        """Per sequence, the distribution its proposal was drawn from (`Sampler.verify`'s `draft_probs`)."""
        return [self.proposer.proposal_probs(seq) for seq in seqs]

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)

    def reset(self) -> None:
        self.proposer.reset()

    def record_step(self, seqs: list[Sequence], num_proposed: list[int], accepted_token_ids: list[list[int]]) -> None:
        """`record` every sequence of a verified step that proposed tokens (after `Scheduler.postprocess`)."""
        for seq, proposed, accepted in zip(seqs, num_proposed, accepted_token_ids, strict=True):
            if proposed:
                self.record(seq, proposed, len(accepted))

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Count one verification of `seq`, adapt its next proposal length, and let the proposer drop what it
        computed for the rejected tokens."""
        self.proposer.rollback(seq)
        seq.num_spec_proposed += num_proposed
        seq.num_spec_accepted += num_accepted
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_verified_seqs += 1
        if num_accepted == num_proposed:
            seq.num_spec_tokens = min(self.config.num_tokens, seq.num_spec_tokens + 1)
        else:
            seq.num_spec_tokens = num_accepted + 1
        if num_accepted:
            seq.num_spec_misses = 0
            return
        seq.num_spec_misses += 1
        if seq.num_spec_misses >= MAX_MISSES:
            seq.num_spec_paused_steps = PAUSE_STEPS
            seq.num_spec_misses = MAX_MISSES - 1  # one more miss after the pause pauses again

    def stats(self) -> dict[str, float | int | str]:
        proposed = self.num_proposed_tokens
        return {
            "spec_method": self.config.method,
            "spec_proposed_tokens_total": proposed,
            "spec_accepted_tokens_total": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / proposed if proposed else 0.0,
            # tokens each verifying sequence gained per step: accepted proposals plus the target's own token
            "spec_mean_tokens_per_step": (
                (self.num_accepted_tokens + self.num_verified_seqs) / self.num_verified_seqs
                if self.num_verified_seqs
                else 0.0
            ),
            **self.proposer.stats(),
        }


def off_stats() -> dict[str, float | int | str]:
    """`Speculator.stats()` of an engine that does not speculate."""
    return Speculator(SpeculativeConfig(), NgramProposer(1, 1)).stats()


def build_speculator(config: SpeculativeConfig, draft: Proposer | None = None) -> Speculator | None:
    """The speculator `config` asks for; `method: draft` needs the engine's `draft` (`DraftProposer.build`)."""
    if config.method == "off":
        return None
    if config.method == "draft":
        if draft is None:
            raise ValueError("speculative method `draft` needs the draft proposer (local_engine/draft.py)")
        return Speculator(config, draft)
    return Speculator(config, NgramProposer(config.ngram_min, config.ngram_max))
