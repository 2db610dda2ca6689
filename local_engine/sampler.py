"""Batched sampling: penalties, temperature, top-k / top-p / min-p and per-request seeds, vectorised over rows.

Random rows draw with the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p and lets
each seeded row use its own generator without breaking the batch into per-row multinomial calls.
Logprobs are those of the raw model distribution (before penalties and temperature), as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from local_engine.output_processor import TokenLogprob
from local_engine.sequence import Sequence

__all__ = ["Sampler", "SamplerOutput", "VerifyOutput"]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class VerifyOutput:
    """Per sequence: its accepted proposed tokens, then the target's own token (`token_ids`), and the logprobs
    of all of them in that order (None entries where the request asked for none)."""

    accepted_token_ids: list[list[int]]
    token_ids: list[int]
    logprobs: list[list[TokenLogprob | None]]


def _exponential_like(values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Exp(1) noise shaped like `values`, as -log(U) with U ~ U[0, 1): the race `argmax(p / E)` picks token i with
    probability p_i. Three times faster than `Tensor.exponential_` on a CPU (0.36 vs 1.10 ms for a 49,152-token
    row), which dominated a sampled row's cost. U = 0 gives E = inf: that token loses the race (2^-24 a token)."""
    return torch.rand(values.shape, generator=generator, device=values.device, dtype=torch.float32).log_().neg_()


class Sampler:
    # top-k / top-p read the best this many tokens of a row when they decide it (`_top_k_top_p`)
    TOP_CANDIDATES = 256

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded sequence
        # seq_id -> (the tokens its prompt and output hold so far, as a [V] mask; the outputs it includes)
        self._seen: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self._seen.pop(seq.seq_id, None)

    def _seen_tokens(self, seq: Sequence, vocab: int, device: torch.device) -> torch.Tensor:
        """[V] bool: the tokens `seq`'s prompt and output hold, what the repetition penalty acts on. Kept per
        sequence and extended by the tokens added since its last step: built from a 3,000-token prompt on every
        step it cost about 1 ms per sequence on a CPU, as much as a decode step of a small model."""
        outputs = seq.output_token_ids
        entry = self._seen.get(seq.seq_id)
        if entry is None or outputs[: len(entry[1])] != entry[1]:  # new, or its output was rewritten: build again
            mask, folded = torch.zeros(vocab, dtype=torch.bool, device=device), 0
            prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=device)
            mask[prompt[prompt < vocab]] = True
        else:
            mask, folded = entry[0], len(entry[1])
        if folded < len(outputs):
            mask[torch.tensor(outputs[folded:], dtype=torch.long, device=device)] = True
        self._seen[seq.seq_id] = (mask, outputs)
        return mask

    def _generator(self, seq: Sequence, device: torch.device) -> torch.Generator:
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            seed = seq.params.seed
            assert seed is not None
            # Siblings of an n > 1 request get distinct, reproducible streams.
            seed = seed if seq.index == 0 else hash((seed, seq.index)) & 0x7FFF_FFFF_FFFF_FFFF
            generator = torch.Generator(device=device).manual_seed(seed)
            self._generators[seq.seq_id] = generator
        return generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits [B, V] float32 for `seqs` (one row each, same order) -> one token per row."""
        vocab = logits.shape[1]
        device = logits.device
        params = [s.params for s in seqs]
        logits, raw_logprobs = self._process(logits, seqs)
        greedy = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            tokens = greedy
        else:
            tokens = torch.where(
                torch.tensor([p.is_greedy for p in params], device=device), greedy, self._sample(logits, seqs)
            )
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, self._logprobs(raw_logprobs, token_ids, seqs, vocab))

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits every pick reads (logit_bias, the min_tokens mask, penalties; one row per entry of `seqs`),
        and the raw log-probabilities when some row reports logprobs."""
        params = [s.params for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, seqs)
        logits = self._mask_min_tokens(logits, seqs)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, seqs)
        return logits, raw_logprobs

    @torch.inference_mode()
    def verify(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> VerifyOutput:
        """logits [sum(1 + len(s.spec_token_ids)), V]: one row per query position of each sequence, in order.
        `draft_probs[i]` (optional): [len(seqs[i].spec_token_ids), V], the distribution q the proposer sampled
        `seqs[i]`'s proposals from; None: a deterministic proposal.

        Deterministic proposals: at each position the target picks its token exactly as `__call__` would (argmax,
        or a sample of the processed distribution); proposed tokens are accepted while they equal the pick, and the
        pick at the first mismatch (or after the last proposal) is the sequence's new token. A seeded sequence draws
        its noise row by row and stops at the first mismatch, so it consumes one draw per token it gains: the same
        stream, and so the same output, as without speculation. Sampled proposals (q given, sampling rows):
        rejection sampling, proposal d accepted with probability min(1, p(d) / q(d)), the first rejected position
        drawing from max(0, p - q) normalised (`_rejection_sample`), which leaves each token distributed as p.
        Requests with penalties or short of `min_tokens` never propose (`local_engine/speculative.py`), so every
        row's processing is the same as a plain step's."""
        proposals = [s.spec_token_ids for s in seqs]
        rows = [s for s, p in zip(seqs, proposals, strict=True) for _ in range(len(p) + 1)]
        vocab = logits.shape[1]
        params = [s.params for s in rows]
        logits, raw_logprobs = self._process(logits, rows)
        picks = logits.argmax(dim=-1)
        # seq index -> (accepted count, token; None: the bonus row's pick) by rejection sampling
        sampled: dict[int, tuple[int, int | None]] = {}
        if not all(p.is_greedy for p in params):
            probs = self._probs(logits, rows)
            picks = self._verify_random(probs, seqs, rows, picks)
            if draft_probs is not None and any(q is not None for q in draft_probs):
                sampled = self._rejection_sample(probs, seqs, draft_probs)
        pick_ids = picks.tolist()
        accepted: list[list[int]] = []
        tokens: list[int] = []
        row = 0
        for i, proposal in enumerate(proposals):
            if i in sampled:
                num_accepted, drawn = sampled[i]
                token = pick_ids[row + num_accepted] if drawn is None else drawn
            else:
                num_accepted = 0
                while num_accepted < len(proposal) and pick_ids[row + num_accepted] == proposal[num_accepted]:
                    num_accepted += 1
                token = pick_ids[row + num_accepted]
            accepted.append(proposal[:num_accepted])
            tokens.append(token)
            # The chosen tokens, for the logprobs: rows past the sequence's new token are never read.
            pick_ids[row : row + num_accepted + 1] = [*proposal[:num_accepted], token]
            row += len(proposal) + 1
        row_logprobs = self._logprobs(raw_logprobs, pick_ids, rows, vocab)
        logprobs: list[list[TokenLogprob | None]] = []
        row = 0
        for proposal, gained in zip(proposals, accepted, strict=True):
            logprobs.append(row_logprobs[row : row + len(gained) + 1])
            row += len(proposal) + 1
        return VerifyOutput(accepted, tokens, logprobs)

    def _verify_random(
        self, probs: torch.Tensor, seqs: list[Sequence], rows: list[Sequence], greedy: torch.Tensor
    ) -> torch.Tensor:
        """The picks of `verify` with sampling rows: unseeded rows race global noise (each row independent);
        seeded rows draw from their generator one position at a time, up to the first mismatch."""
        device = probs.device
        generators = [
            self._generator(s, device) if s.params.seed is not None and not s.params.is_greedy else None for s in seqs
        ]
        noise = _exponential_like(probs)
        is_greedy = torch.tensor([s.params.is_greedy for s in rows], device=device)
        picks = torch.where(is_greedy, greedy, (probs / noise).argmax(dim=-1))
        row = 0
        for seq, generator in zip(seqs, generators, strict=True):
            proposal = seq.spec_token_ids
            if generator is not None:
                for j in range(len(proposal) + 1):
                    draw = _exponential_like(probs[row + j], generator)
                    pick = int((probs[row + j] / draw).argmax())
                    picks[row + j] = pick
                    if j == len(proposal) or pick != proposal[j]:
                        break
            row += len(proposal) + 1
        return picks

    def _rejection_sample(
        self, probs: torch.Tensor, seqs: list[Sequence], draft_probs: list[torch.Tensor | None]
    ) -> dict[int, tuple[int, int | None]]:
        """For each unseeded sampling sequence whose proposal came with its distribution q: (accepted count, new
        token). Proposal j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) (`u * q < p`, u ~ U[0, 1));
        the first rejected position draws from max(0, p - q) normalised (from p itself in the measure-zero case
        where that is all zero); a fully accepted proposal's token is None: the bonus row's own draw from p."""
        result: dict[int, tuple[int, int | None]] = {}
        row = 0
        for i, (seq, q) in enumerate(zip(seqs, draft_probs, strict=True)):
            proposal = seq.spec_token_ids
            num = len(proposal)
            if q is not None and num and not seq.params.is_greedy and seq.params.seed is None:
                p = probs[row : row + num]
                q = q[:num].to(p.device, p.dtype)
                index = torch.tensor(proposal, device=p.device)[:, None]
                p_d = p.gather(1, index).squeeze(1)
                q_d = q.gather(1, index).squeeze(1)
                rejected = (torch.rand(num, device=p.device) * q_d >= p_d).tolist()
                num_accepted = rejected.index(True) if True in rejected else num
                if num_accepted < num:
                    residual = (p[num_accepted] - q[num_accepted]).clamp_min(0.0)
                    if not float(residual.sum()) > 0.0:
                        residual = p[num_accepted]
                    noise = _exponential_like(residual)
                    result[i] = (num_accepted, int((residual / noise).argmax()))
                else:
                    result[i] = (num, None)
            row += num + 1
        return result

    @torch.inference_mode()
    def propose(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """A draft model's picks from its logits [B, V] (one row per sequence) and the distribution q [B, V] they
        were drawn from (None when no row samples). Greedy and seeded requests get the argmax: a deterministic
        proposal, verified by accept-if-sampled, so a seeded request's output stays that of its seed. The others
        draw from the processed distribution (logit_bias, temperature, top-k / top-p, min-p), from global noise."""
        logits, _ = self._process(logits, seqs)
        greedy = logits.argmax(dim=-1)
        is_deterministic = [s.params.is_greedy or s.params.seed is not None for s in seqs]
        if all(is_deterministic):
            return greedy.tolist(), None
        probs = self._probs(logits, seqs)
        noise = _exponential_like(probs)
        drawn = (probs / noise).argmax(dim=-1)
        picks = torch.where(torch.tensor(is_deterministic, device=logits.device), greedy, drawn)
        return picks.tolist(), probs

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """OpenAI `logit_bias`: each request's biases added to its row (-100 or 100 in effect ban or force)."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, seq in enumerate(seqs):
            for token_id, bias in seq.params.logit_bias:
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)

    def _mask_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Before min_tokens are out, EOS and stop token ids cannot be sampled."""
        rows: list[int] = []
        cols: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
                rows.extend([i] * len(banned))
                cols.extend(banned)
        if rows:
            logits = logits.clone()
            logits[rows, cols] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """OpenAI presence/frequency penalties over generated tokens; repetition penalty (CTRL / HF style) over
        prompt and generated tokens. Each part only for the batches whose requests ask for it (decided on the host:
        no device sync)."""
        num_rows, vocab = logits.shape
        device = logits.device
        params = [s.params for s in seqs]
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            outputs = [s.output_token_ids for s in seqs]
            width = max(1, max(len(o) for o in outputs))
            padded = torch.tensor([o + [vocab] * (width - len(o)) for o in outputs], device=device)
            counts = torch.zeros(num_rows, vocab + 1, device=device).scatter_add_(
                1, padded, torch.ones_like(padded, dtype=torch.float32)
            )[:, :vocab]
            presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
            logits = logits - frequency * counts - presence * (counts > 0).float()
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rows:
            seen = torch.stack([self._seen_tokens(seqs[i], vocab, device) for i in rows])
            repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=device)[:, None]
            index = torch.tensor(rows, device=device)
            selected = logits.index_select(0, index)
            penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
            logits = logits.index_copy(0, index, torch.where(seen, penalised, selected))
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        # Generators first: if one row's cannot be made, no other seeded row has drawn yet, and the engine's
        # row-by-row retry (which fails only that row's request) keeps the others reproducible.
        generators = [
            self._generator(s, device) if s.params.seed is not None and not s.params.is_greedy else None for s in seqs
        ]
        probs = self._probs(logits, seqs)
        noise = _exponential_like(probs)
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i] = _exponential_like(noise[i], generator)
        return (probs / noise).argmax(dim=-1)

    def _probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The distribution each row samples from: temperature, top-k / top-p, min-p."""
        device = logits.device
        params = [s.params for s in seqs]
        # Greedy rows are replaced by the argmax afterwards; temperature 1 keeps them finite meanwhile.
        temperatures = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
        # A penalty or temperature can push a logit past float32's range; +inf would make the softmax NaN.
        logits = (logits / temperatures[:, None]).clamp(max=torch.finfo(logits.dtype).max)
        if any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    def _top_k_top_p(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Keep each row's `top_k` best tokens, then the fewest of those whose probability (renormalised over them)
        reaches `top_p` (the best token always stays); the rest become -inf.

        Read from the `TOP_CANDIDATES` best tokens when that decides every row: a row with a `top_k` within them,
        or whose nucleus they hold (their probability reaches `top_p`). Otherwise, for a flat distribution, from
        the whole vocabulary sorted. On a CPU the sort costs ~4 ms a 49,152-token row, the selection ~0.15 ms."""
        vocab = logits.shape[1]
        device = logits.device
        top_k = [min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs]
        top_p_values = [s.params.top_p for s in seqs]
        top_p = torch.tensor(top_p_values, device=device)
        # a row with neither filter keeps every token (its sums' rounding must not cut its tail)
        untouched = torch.tensor([k >= vocab and p >= 1.0 for k, p in zip(top_k, top_p_values, strict=True)])
        num = min(vocab, max([self.TOP_CANDIDATES, *(k for k in top_k if k < vocab)]))
        if num < vocab and device.type == "cpu":  # (on a GPU the sort is cheap and the check below would sync)
            best, order = logits.topk(num, dim=-1)
            kept = self._nucleus(best, top_k, top_p, logits)
            within = torch.tensor([k <= num for k in top_k])
            # decided: the row keeps all, its top-k lies within the candidates, or its nucleus ends before the last
            if bool((untouched | within | kept[:, -1].logical_not()).all()):
                remove = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, kept.logical_not())
                return logits.masked_fill(remove.masked_fill_(untouched[:, None].to(device), False), float("-inf"))
        best, order = logits.sort(dim=-1, descending=True)
        kept = self._nucleus(best, top_k, top_p, logits)
        remove = torch.empty_like(kept).scatter_(1, order, kept.logical_not())
        return logits.masked_fill(remove.masked_fill_(untouched[:, None].to(device), False), float("-inf"))

    @staticmethod
    def _nucleus(best: torch.Tensor, top_k: list[int], top_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """[B, n] bool: which of each row's `n` best logits (descending) top-k and then top-p keep. The top-p
        probabilities are renormalised over the row's top-k tokens: over `best` when they hold them all, over the
        whole row (its logsumexp) when top-k is off."""
        vocab = logits.shape[1]
        device = best.device
        ranks = torch.arange(best.shape[1], device=device)[None, :]
        limit = torch.tensor(top_k, device=device)[:, None]
        outside = ranks >= limit
        restricted = best.masked_fill(outside, float("-inf"))
        off = torch.tensor([k >= vocab for k in top_k], device=device)[:, None]
        total = torch.where(off, torch.logsumexp(logits, dim=-1, keepdim=True), torch.logsumexp(restricted, -1, True))
        probs = torch.exp(restricted - total)
        # Drop a token when the tokens ranked above it already reach top_p (the best token always stays); top_p 1
        # drops nothing, even where the sum's rounding reaches 1 before the tail of a peaked row.
        reached = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]
        reached[:, 0] = False  # a top_p of 0 (or one below float32's smallest) still keeps the best token
        return ~(outside | reached)

    def _logprobs(
        self, raw: torch.Tensor | None, token_ids: list[int], seqs: list[Sequence], vocab: int
    ) -> list[TokenLogprob | None]:
        if raw is None:
            return [None] * len(seqs)
        max_top = max(s.params.logprobs or 0 for s in seqs)
        chosen = raw.gather(1, torch.tensor(token_ids, device=raw.device)[:, None]).squeeze(1).tolist()
        top_values: list[list[float]] = [[] for _ in seqs]
        top_ids: list[list[int]] = [[] for _ in seqs]
        if max_top:
            values, indices = raw.topk(min(max_top, vocab), dim=-1)
            top_values, top_ids = values.tolist(), indices.tolist()
        result: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                result.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_values[i][:k], strict=True))
            result.append(TokenLogprob(token_ids[i], chosen[i], top))
        return result
