"""The `draft` proposer: a second, cheaper model with the target's vocabulary proposes each sequence's next tokens.

The draft is a `ModelRunner` of its own (weights and paged KV cache; as many KV blocks as the target's cache), and
its KV blocks are kept by a `BlockManager` of its own under the same rules as the target's: a block table per
sequence, prefix-cache hashes for full blocks of the target's tokens only, the tail past the tokens the draft
still trusts freed after each verification, everything freed when the sequence finishes, is preempted or aborted.

Each step, for the sequences that speculate (`Speculator.propose`), the draft first catches up on the target's
tokens it holds no KV for (the tokens accepted and the target's own token from the last verification; after a
preemption or a pause, more: its whole prefix after a restart, in chunks of `max_num_batched_tokens`); the logits
of each sequence's last token give its first proposal. Then `k - 1` decode steps, batched over the sequences still
proposing, give the rest. Greedy and seeded requests take the draft's argmax; the others draw from the draft's
processed distribution q, kept for the rejection sampling of `Sampler.verify`.

Cheaper forms of the target itself (no smaller model of the same family ships here): `draft_dtype` (e.g. a
bfloat16 copy drafting for a float32 target) and `draft_num_layers` (only the first layers, then the final norm and
the output head: an early-exit draft).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from local_engine.block_manager import BlockManager
from local_engine.config import EngineConfig, KVCapacity, ModelConfig, SpeculativeConfig
from local_engine.errors import ModelLoadError
from local_engine.model_runner import TORCH_DTYPES, ModelRunner
from local_engine.sampler import Sampler
from local_engine.scheduler import ScheduledBatch
from local_engine.sequence import Sequence, SequenceStatus
from local_engine.speculative import Proposer

__all__ = ["DraftProposer"]

logger = logging.getLogger("unigate.engine")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _DraftSeq:
    """The draft's view of one target sequence: its own token list (the target's tokens, then the proposals of the
    last step), block table and count of tokens with KV; `num_real` leading tokens are the target's."""

    target: Sequence
    seq: Sequence
    num_real: int


class DraftProposer(Proposer):
    def __init__(self, runner: ModelRunner, *, enable_prefix_caching: bool, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sampler = Sampler()
        self.block_manager = BlockManager(
            runner.capacity.num_blocks, runner.block_size, enable_prefix_caching=enable_prefix_caching
        )
        self.drafts: dict[int, _DraftSeq] = {}  # target seq_id -> its draft view
        self._probs: dict[int, torch.Tensor] = {}  # target seq_id -> q [k, V] of this step's sampled proposal

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        target: ModelConfig,
        target_capacity: KVCapacity,
        state_dict: dict[str, torch.Tensor],
        block_weights: Mapping[str, tuple[str, np.ndarray]] | None = None,
        *,
        cache_dir: Path | None = None,
    ) -> DraftProposer:
        """The draft `config.speculative` names for a target of shape `target` whose KV cache is
        `target_capacity`: `draft_model_path` loaded (GGUF conversions cached under `cache_dir`), or the target's
        own `state_dict` / `block_weights`; in `draft_dtype`, cut to `draft_num_layers`."""
        spec = config.speculative
        device = config.resolved_device(torch.cuda.is_available())
        dtype = config.resolved_dtype(device) if spec.draft_dtype == "auto" else spec.draft_dtype
        model = target
        if spec.draft_model_path is not None:
            from local_engine.loader import load_checkpoint

            checkpoint = load_checkpoint(spec.draft_model_path, cache_dir=cache_dir, dtype=TORCH_DTYPES[dtype])
            model = ModelConfig.from_hf_config(checkpoint.hf_config)
            state_dict, block_weights = checkpoint.state_dict, checkpoint.blocks
        if model.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"the draft model's vocabulary ({model.vocab_size} tokens) is not the target's ({target.vocab_size}):"
                " a draft must share the target's tokenizer (UNIGATE_ENGINE__SPECULATIVE__DRAFT_MODEL_PATH)"
            )
        if spec.draft_num_layers is not None:
            model, state_dict, block_weights = _first_layers(model, state_dict, block_weights, spec.draft_num_layers)
        # As many KV blocks as the target's cache: a sequence the target holds fits the draft too.
        kv_dtype = config.resolved_kv_cache_dtype(dtype)
        block_bytes = model.kv_bytes_per_token(kv_dtype) * config.block_size + model.kv_scale_bytes_per_block(kv_dtype)
        options: dict[str, Any] = {
            "dtype": dtype,
            "kv_cache_memory": target_capacity.num_blocks * block_bytes,
            "speculative": SpeculativeConfig(),
        }
        try:
            runner = ModelRunner(model, config.model_copy(update=options), state_dict, block_weights)
        except torch.cuda.OutOfMemoryError as exc:
            raise ModelLoadError(
                "the draft model and its KV cache do not fit next to the target: lower gpu_memory_utilization (the "
                "target takes that share of the GPU), or kv_cache_memory"
            ) from exc
        logger.info(
            "speculative decoding with a draft model: %s%s, %s, %d layers, %.0f MiB of weights",
            spec.draft_model_path or "the target's own weights",
            "" if spec.draft_num_layers is None else f" (first {spec.draft_num_layers} layers)",
            runner.dtype_name,
            model.num_hidden_layers,
            runner.weights_bytes / 2**20,
        )
        return cls(
            runner,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )

    # -- the proposer's hooks -----------------------------------------------------------------------------------

    def propose_batch(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        self._probs.clear()
        for stale in [d.target for d in self.drafts.values() if d.target.status is not SequenceStatus.RUNNING]:
            self.forget(stale)  # finished or preempted without a hook call (a request that failed mid-step)
        chosen: list[tuple[int, _DraftSeq, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens, strict=True)):
            # positions up to len + k - 2 get KV (the last proposal never does)
            k = min(k, self.runner.max_model_len + 1 - len(seq.token_ids))
            draft = self._reserve(seq, k) if k > 0 else None
            if draft is not None:
                chosen.append((i, draft, k))
        proposals: list[list[int]] = [[] for _ in seqs]
        if not chosen:
            return proposals
        drafts = [draft for _, draft, _ in chosen]
        logits = self._catch_up(drafts)
        q_rows: list[list[torch.Tensor]] = [[] for _ in chosen]
        active = list(range(len(chosen)))
        for j in range(max(k for _, _, k in chosen)):
            if j:  # a decode step over the sequences still proposing, each fed its last proposal
                active = [a for a in active if chosen[a][2] > j]
                for a in active:
                    drafts[a].seq.token_ids.append(proposals[chosen[a][0]][-1])
                logits = self._decode([drafts[a] for a in active])
            token_ids, probs = self.sampler.propose(logits, [drafts[a].target for a in active])
            for row, (a, token_id) in enumerate(zip(active, token_ids, strict=True)):
                proposals[chosen[a][0]].append(token_id)
                if probs is not None:
                    q_rows[a].append(probs[row])
        for (_, draft, _), rows in zip(chosen, q_rows, strict=True):
            params = draft.target.params
            if rows and not params.is_greedy and params.seed is None:
                self._probs[draft.target.seq_id] = torch.stack(rows)
        return proposals

    def proposal_probs(self, seq: Sequence) -> torch.Tensor | None:
        return self._probs.get(seq.seq_id)

    def rollback(self, seq: Sequence) -> None:
        draft = self.drafts.get(seq.seq_id)
        if draft is not None:
            self._sync(draft)

    def forget(self, seq: Sequence) -> None:
        self._probs.pop(seq.seq_id, None)
        draft = self.drafts.pop(seq.seq_id, None)
        if draft is not None:
            self.block_manager.free(draft.seq)

    def reset(self) -> None:
        self.drafts.clear()
        self._probs.clear()
        self.block_manager = BlockManager(
            self.runner.capacity.num_blocks, self.runner.block_size, enable_prefix_caching=self.enable_prefix_caching
        )

    def stats(self) -> dict[str, float | int | str]:
        bm = self.block_manager
        return {
            "spec_draft_dtype": self.runner.dtype_name,
            "spec_draft_num_layers": self.runner.model_config.num_hidden_layers,
            "spec_draft_kv_blocks_total": bm.num_blocks,
            "spec_draft_kv_blocks_free": bm.num_free_blocks,
        }

    # -- KV bookkeeping -----------------------------------------------------------------------------------------

    def _reserve(self, seq: Sequence, k: int) -> _DraftSeq | None:
        """The draft view of `seq`, synced to its tokens, with blocks for `k` proposals (the target's tokens and
        all proposals but the last get KV); None when the draft's cache is short (the sequence decodes normally)."""
        bm = self.block_manager
        num_positions = len(seq.token_ids) + k - 1
        draft = self.drafts.get(seq.seq_id)
        if draft is None:
            view = Sequence(
                seq.request_id, seq.prompt_token_ids, seq.params, max_tokens=seq.max_tokens, index=seq.index
            )
            view.token_ids.extend(seq.output_token_ids)
            computed = bm.get_computed_blocks(view)
            num_new = num_positions - len(computed) * bm.block_size
            if not bm.can_allocate(view, computed, num_new):
                return None
            bm.allocate(view, computed, num_new)
            draft = self.drafts[seq.seq_id] = _DraftSeq(seq, view, len(view.token_ids))
            return draft
        self._sync(draft)
        num_new = num_positions - draft.seq.num_computed_tokens
        if not bm.can_append(draft.seq, num_new):
            return None
        bm.may_append(draft.seq, num_new)
        return draft

    def _sync(self, draft: _DraftSeq) -> None:
        """Make the draft's tokens the target's again: its KV stays valid up to the first token where the two differ
        (a rejected proposal), and the blocks past the last valid token are freed."""
        tokens, own = draft.target.token_ids, draft.seq.token_ids
        common = draft.num_real
        limit = min(len(own), len(tokens))
        while common < limit and own[common] == tokens[common]:
            common += 1
        del own[common:]
        own.extend(tokens[common:])
        draft.num_real = len(own)
        view = draft.seq
        # The last token is always computed again (the same KV, rewritten): its logits give the first proposal.
        view.num_computed_tokens = min(view.num_computed_tokens, common, len(own) - 1)
        self.block_manager.truncate(view)

    # -- forward passes -----------------------------------------------------------------------------------------

    def _catch_up(self, drafts: list[_DraftSeq]) -> torch.Tensor:
        """Compute the KV of every draft's target tokens it lacks, in chunks of at most `max_num_batched_tokens`;
        the logits of each one's last token [len(drafts), V], in order."""
        rows: list[torch.Tensor | None] = [None] * len(drafts)
        pending = list(range(len(drafts)))
        while pending:
            budget = self.max_num_batched_tokens
            decodes: list[int] = []
            prefills: list[tuple[int, int]] = []
            for i in pending:
                view = drafts[i].seq
                remaining = len(view.token_ids) - view.num_computed_tokens
                if remaining == 1:
                    decodes.append(i)
                    budget -= 1
                elif budget > 0:
                    prefills.append((i, min(remaining, budget)))
                    budget -= prefills[-1][1]
            batch = ScheduledBatch(
                seqs=[drafts[i].seq for i in decodes] + [drafts[i].seq for i, _ in prefills],
                num_new_tokens=[1] * len(decodes) + [n for _, n in prefills],
                num_decode_seqs=len(decodes),
            )
            logits = self.runner.run(batch)
            finished = decodes + [i for i, n in prefills if drafts[i].seq.num_computed_tokens + n == drafts[i].num_real]
            for row, i in enumerate(finished):
                rows[i] = logits[row]
            for i, n in [(i, 1) for i in decodes] + prefills:
                view = drafts[i].seq
                before = view.num_computed_tokens
                view.num_computed_tokens += n
                self.block_manager.cache_full_blocks(view, before)  # the target's tokens only, so hashable
            pending = [i for i in pending if rows[i] is None]
        return torch.stack([row for row in rows if row is not None])

    def _decode(self, drafts: list[_DraftSeq]) -> torch.Tensor:
        """One decode step of each draft's last token (a proposal: its KV is not hashed); logits [len(drafts), V]."""
        batch = ScheduledBatch(
            seqs=[draft.seq for draft in drafts], num_new_tokens=[1] * len(drafts), num_decode_seqs=len(drafts)
        )
        logits = self.runner.run(batch)
        for draft in drafts:
            draft.seq.num_computed_tokens += 1
        return logits


def _first_layers(
    model: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    block_weights: Mapping[str, tuple[str, np.ndarray]] | None,
    num_layers: int,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, tuple[str, np.ndarray]] | None]:
    """The model cut to its first `num_layers` decoder layers (the final norm and the output head kept)."""
    if num_layers > model.num_hidden_layers:
        raise ModelLoadError(
            f"draft_num_layers ({num_layers}) exceeds the draft model's {model.num_hidden_layers} layers: lower it or "
            "unset it (all layers)"
        )

    def is_kept(name: str) -> bool:
        match = _LAYER.search(name)
        return match is None or int(match.group(1)) < num_layers

    kept = {name: tensor for name, tensor in state_dict.items() if is_kept(name)}
    blocks = None if block_weights is None else {n: b for n, b in block_weights.items() if is_kept(n)}
    return dataclasses.replace(model, num_hidden_layers=num_layers), kept, blocks
