"""The new tokens of one engine step: `sample` draws one per sampling sequence; in a step where sequences proposed
tokens, `verify` checks the proposals against the target's logits (speculative verification; the proposals come
from `speculative.Speculator`, the acceptance rule is `Sampler.verify`).

Both isolate failures the same way: when the batched call raises, the rows are redone one request at a time, and
only the requests whose own rows raise fail (`StepTokens.failed`; their rows get placeholder tokens, and the engine
aborts those requests after `Scheduler.postprocess`).

    new = verify(speculator, sampler, logits, seqs)     # (a step without proposals: sample(sampler, logits, seqs))
    scheduler.postprocess(batch, new.token_ids, new.accepted_token_ids)
    speculator.record_step(seqs, new.num_proposed, new.accepted_token_ids)   # the proposer drops its rejected tail
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from local_engine.output_processor import TokenLogprob
from local_engine.sampler import Sampler, VerifyOutput
from local_engine.sequence import Sequence
from local_engine.speculative import Speculator

__all__ = ["StepTokens", "sample", "verify"]


@dataclass
class StepTokens:
    """Per sampling sequence of a step, in batch order: the target's token, and the logprobs of the tokens the
    sequence gains (accepted proposals first, then that token; None entries where the request asked for none)."""

    token_ids: list[int]
    logprobs: list[list[TokenLogprob | None]]
    # request id -> what its rows raised: the request fails alone
    failed: dict[str, Exception] = field(default_factory=dict)
    # a verification: per sequence, its accepted proposed tokens (they come before its token) and how many it proposed
    accepted_token_ids: list[list[int]] | None = None
    num_proposed: list[int] = field(default_factory=list)


def sample(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> StepTokens:
    """One token per row of `logits` [len(seqs), V]; when the batch raises, row by row."""
    try:
        out = sampler(logits, seqs)
        return StepTokens(out.token_ids, [[logprob] for logprob in out.logprobs])
    except Exception:
        pass
    new = StepTokens([], [])
    for row, seq in enumerate(seqs):
        try:
            out = sampler(logits[row : row + 1], [seq])
        except Exception as error:
            new.failed.setdefault(seq.request_id, error)
            new.token_ids.append(0)
            new.logprobs.append([None])
        else:
            new.token_ids.extend(out.token_ids)
            new.logprobs.extend([logprob] for logprob in out.logprobs)
    return new


def verify(speculator: Speculator, sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> StepTokens:
    """`Sampler.verify` of each sequence's proposal (`seq.spec_token_ids`, possibly none) against its rows of
    `logits` [sum(1 + len(proposal)), V]; when the batch raises, sequence by sequence."""
    num_proposed = [len(s.spec_token_ids) for s in seqs]
    draft_probs = speculator.proposal_probs(seqs)
    failed: dict[str, Exception] = {}
    try:
        verified = sampler.verify(logits, seqs, draft_probs)
    except Exception:
        verified = VerifyOutput([], [], [])
        row = 0
        for seq, q, proposed in zip(seqs, draft_probs, num_proposed, strict=True):
            num_rows = proposed + 1
            try:
                out = sampler.verify(logits[row : row + num_rows], [seq], [q])
            except Exception as error:
                failed.setdefault(seq.request_id, error)
                out = VerifyOutput([[]], [0], [[None]])
            verified.accepted_token_ids.extend(out.accepted_token_ids)
            verified.token_ids.extend(out.token_ids)
            verified.logprobs.extend(out.logprobs)
            row += num_rows
    return StepTokens(verified.token_ids, verified.logprobs, failed, verified.accepted_token_ids, num_proposed)
