"""Speculative decoding: prompt lookup, verification inside the step, rollback of rejected tokens, and exactness
(greedy and seeded outputs identical to decoding without it; sampled tokens distributed like the target's)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq
from typing import Any

import pytest
import torch

from local_engine.config import SpeculativeConfig
from local_engine.output_processor import RequestOutput, accumulate
from local_engine.sampling_params import SamplingParams
from local_engine.sequence import Sequence
from local_engine.speculative import MAX_MISSES, PAUSE_STEPS, NgramProposer, Proposer, Speculator

VOCAB = 160
NGRAM = {"method": "ngram", "ngram_min": 1, "max_num_seqs": 256}


def seq_of(tokens: list[int], num_prompt: int | None = None, **params: Any) -> Sequence:
    seq = Sequence("r", tokens[:num_prompt] if num_prompt else tokens, SamplingParams(**params), max_tokens=100)
    for token in tokens[num_prompt or len(tokens) :]:
        seq.append_token(token)
    seq.num_computed_tokens = len(seq.token_ids) - 1  # decoding
    return seq


# -- the proposer and the adaptive length ---------------------------------------------------------------------------


def test_ngram_finds_the_most_recent_longest_match() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    # "1 2 3" occurs at 0 (followed by 9) and at 5 (followed by 7 8): the most recent wins.
    assert proposer.propose(seq_of([1, 2, 3, 9, 0, 1, 2, 3, 7, 8, 5, 1, 2, 3]), 4) == [7, 8, 5, 1]
    assert proposer.propose(seq_of([1, 2, 3, 9, 0, 1, 2, 3, 7, 8, 5, 1, 2, 3]), 1) == [7]
    # No 3- or 2-gram match: the 1-gram "3" (most recent earlier occurrence at 2) proposes one token.
    assert proposer.propose(seq_of([4, 5, 3, 6, 6, 8, 3]), 2) == [6]
    assert NgramProposer(min_n=2, max_n=3).propose(seq_of([4, 5, 3, 6, 6, 8, 3]), 2) == []
    assert proposer.propose(seq_of([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert proposer.propose(seq_of([7]), 3) == []
    # The match may overlap the suffix itself (a run of one token).
    assert proposer.propose(seq_of([5, 5, 5]), 3) == [5]


def test_ngram_prefers_the_longest_match_to_the_most_recent() -> None:
    # "8 1 2 3" (4 tokens) matched at 3..6 beats the more recent "1 2 3" at 9..11; at most max_n are compared.
    tokens = [0, 0, 0, 8, 1, 2, 3, 4, 5, 1, 2, 3, 6, 9, 8, 1, 2, 3]
    assert NgramProposer(min_n=2, max_n=16).propose(seq_of(tokens), 8) == [4, 5, 1, 2, 3, 6]
    assert NgramProposer(min_n=2, max_n=3).propose(seq_of(tokens), 8) == [6, 9, 8, 1]


def test_ngram_proposes_at_most_one_and_a_half_times_the_match() -> None:
    prefix = list(range(100, 140))
    for n in range(1, 12):
        tokens = [7, *prefix[:n], *range(200, 230), 9, *prefix[:n]]  # the n-token suffix matches once
        got = NgramProposer(min_n=1, max_n=32).propose(seq_of(tokens), 16)
        assert got == list(range(200, 200 + min(16, max(1, n * 3 // 2)))), n


def test_ngram_against_a_reference_search() -> None:
    """The vectorised search equals a plain one on random sequences with many repeats."""
    rng = torch.Generator().manual_seed(3)

    def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
        best_n, best_end = 0, -1
        for end in range(len(tokens) - 2, -1, -1):
            n = 0
            while n < max_n and end - n >= 0 and tokens[end - n] == tokens[len(tokens) - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
        if best_n < max(min_n, 1):
            return []
        return tokens[best_end + 1 : best_end + 1 + min(k, max(1, best_n * 3 // 2))]

    for _ in range(300):
        length = int(torch.randint(1, 60, (1,), generator=rng))
        vocab = int(torch.randint(2, 6, (1,), generator=rng))
        tokens = torch.randint(0, vocab, (length,), generator=rng).tolist()
        min_n = int(torch.randint(1, 4, (1,), generator=rng))
        max_n = min_n + int(torch.randint(0, 6, (1,), generator=rng))
        k = int(torch.randint(1, 10, (1,), generator=rng))
        assert NgramProposer(min_n, max_n).propose(seq_of(tokens), k) == reference(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


def test_ngram_proposals_are_not_shortened_by_misses_but_a_streak_pauses_them() -> None:
    """Prompt lookup picks its own length: a miss does not shorten the next proposal; a streak of misses pauses."""
    config = SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, max_num_seqs=2)
    speculator = Speculator(config, NgramProposer(1, 16))
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    seq = seq_of(tokens, num_prompt=len(tokens))
    for accepted in [1, *[0] * MAX_MISSES]:
        speculator.propose([seq], max_model_len=1000)
        assert seq.spec_token_ids == [1, 2, 3, 4]
        speculator.record(seq, 4, accepted)
    for _ in range(PAUSE_STEPS):
        speculator.propose([seq], max_model_len=1000)
        assert seq.spec_token_ids == []
    speculator.propose([seq], max_model_len=1000)
    assert seq.spec_token_ids == [1, 2, 3, 4]
    speculator.propose([seq], max_model_len=len(tokens) + 2)
    assert seq.spec_token_ids == [1]  # room for the target's own token after the proposals


class _Repeater(Proposer):
    """A proposer whose length the speculator adapts (as a draft model's): proposes the sequence's own tokens."""

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        return seq.token_ids[:num_tokens]


def test_proposals_respect_limits_and_adapt() -> None:
    config = SpeculativeConfig(method="ngram", num_tokens=4, ngram_min=1, max_num_seqs=2)
    speculator = Speculator(config, _Repeater())
    tokens = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    seq = seq_of(tokens, num_prompt=len(tokens))
    speculator.propose([seq], max_model_len=1000)
    assert seq.spec_token_ids == [1, 2, 3, 4]
    speculator.propose([seq, seq_of(tokens), seq_of(tokens)], max_model_len=1000)
    assert seq.spec_token_ids == []  # more running sequences than max_num_seqs: decode normally
    speculator.propose([seq], max_model_len=len(tokens) + 3)
    assert seq.spec_token_ids == [1, 2]  # room for the target's own token after the proposals
    # Partly accepted: the next proposal is what was accepted plus one; all accepted: one longer.
    speculator.record(seq, 4, 1)
    assert seq.num_spec_tokens == 2
    speculator.record(seq, 2, 2)
    assert seq.num_spec_tokens == 3
    for _ in range(MAX_MISSES):
        speculator.record(seq, 1, 0)
    for _ in range(PAUSE_STEPS):  # a streak of misses pauses proposals, then one token is tried again
        speculator.propose([seq], max_model_len=1000)
        assert seq.spec_token_ids == []
    speculator.propose([seq], max_model_len=1000)
    assert seq.spec_token_ids == [1]
    assert speculator.stats()["spec_proposed_tokens_total"] == 4 + 2 + MAX_MISSES
    assert speculator.stats()["spec_accepted_tokens_total"] == 3


@pytest.mark.parametrize(
    "params", [{"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2}, {"min_tokens": 50}]
)
def test_requests_that_never_speculate(params: dict[str, Any]) -> None:
    speculator = Speculator(SpeculativeConfig(method="ngram", ngram_min=1), NgramProposer(1, 3))
    seq = seq_of([1, 2, 1, 2, 1, 2], num_prompt=2, **params)
    speculator.propose([seq], max_model_len=1000)
    assert seq.spec_token_ids == []


# -- the engine -------------------------------------------------------------------------------------------------


class ReplayProposer(Proposer):
    """Proposes a reference run's own continuation, with every third proposal's last token wrong: verification
    sees full acceptances, partial ones and rejections."""

    def __init__(self, reference: dict[tuple[int, ...], list[list[int]]]) -> None:
        self.reference = reference  # prompt -> each choice's prompt + output
        self.num_calls = 0

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        self.num_calls += 1
        full = self.reference[tuple(seq.prompt_token_ids)][seq.index]
        proposal = full[len(seq.token_ids) : len(seq.token_ids) + num_tokens]
        if proposal and self.num_calls % 3 == 0:
            proposal[-1] = (proposal[-1] + 1) % VOCAB
        return proposal


class LetterTokenizer:
    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9] * 4, list(range(60, 75))]


def run(engine: Any, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[RequestOutput]]:
    """Every prompt to completion through `step()`, keeping the deltas."""
    deltas: dict[str, list[RequestOutput]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        deltas[f"r{i}"] = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None
            deltas[out.request_id].append(out)
        engine.block_manager.check_invariants(engine.scheduler.running)
    return [deltas[f"r{i}"] for i in range(len(prompts))]


def replay_engine(model: Any, reference: list[list[RequestOutput]], n: int, **overrides: Any) -> Any:
    engine = model.engine(speculative=NGRAM, **overrides)
    engine.tokenizer = LetterTokenizer()
    by_prompt = {
        tuple(prompt): [prompt + c.token_ids for c in accumulate(deltas, n)]
        for prompt, deltas in zip(PROMPTS, reference, strict=True)
    }
    engine.speculator.proposer = ReplayProposer(by_prompt)
    return engine


def choices(deltas: list[list[RequestOutput]], n: int = 1) -> list[list[tuple[Any, ...]]]:
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, c.num_output_tokens, len(c.logprobs or []))
            for c in accumulate(d, n)
        ]
        for d in deltas
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop=("mno",), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(41,), ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, seed=11, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=17, seed=5, n=3, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, seed=3, logit_bias=((7, 5.0),), ignore_eos=True),
    ],
    ids=["greedy", "stop-string", "stop-token", "seeded-logprobs", "seeded-n3-top-p-k", "logit-bias"],
)
def test_outputs_equal_decoding_without_speculation(llama: Any, params: SamplingParams) -> None:
    """Greedy and seeded requests give the same tokens, text, finish and logprobs with speculation on, while
    proposals are accepted whole, in part and not at all, and several tokens arrive in one delta."""
    plain = llama.engine()
    plain.tokenizer = LetterTokenizer()
    reference = run(plain, params)
    engine = replay_engine(llama, reference, params.n)
    deltas = run(engine, params)
    assert choices(deltas, params.n) == choices(reference, params.n)
    stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] > 0
    assert stats["spec_accepted_tokens_total"] < stats["spec_proposed_tokens_total"]
    assert any(len(c.token_ids) > 1 for d in deltas for out in d for c in out.outputs)
    final = [d[-1] for d in deltas]
    assert sum(f.num_spec_proposed for f in final) == stats["spec_proposed_tokens_total"]
    assert sum(f.num_spec_accepted for f in final) == stats["spec_accepted_tokens_total"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if params.logprobs:
        for got, want in zip(deltas, reference, strict=True):
            for a, b in zip(accumulate(got, params.n), accumulate(want, params.n), strict=True):
                assert a.logprobs is not None and b.logprobs is not None
                assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
                torch.testing.assert_close(
                    torch.tensor([x.logprob for x in a.logprobs]), torch.tensor([x.logprob for x in b.logprobs])
                )


def test_rejected_tokens_leave_no_kv_behind_and_cache_only_accepted_blocks(llama: Any) -> None:
    """Prompt lookup on a repeating prompt (a tiny random model rarely follows it): rejected tails are freed at
    once, and the prefix cache then serves the same prompt + output as computed, not as proposed."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [[9, 8, 7, 6, 5, 4, 3, 2] * 5]
    engine = llama.engine(speculative=NGRAM)
    [deltas] = run(engine, params, prompt)
    assert engine.stats()["spec_proposed_tokens_total"] > engine.stats()["spec_accepted_tokens_total"]
    [choice] = accumulate(deltas, 1)
    plain = llama.engine()
    assert plain.generate(prompt, params)[0][0].token_ids == choice.token_ids
    # Every cached block's tokens are a real prefix of prompt + output.
    full = prompt[0] + choice.token_ids
    size = engine.block_manager.block_size
    for block in engine.block_manager.blocks:
        if block.block_hash is not None:
            start = full.index(block.token_ids[0]) if block.parent_hash is None else None
            assert start in (None, 0)
            assert any(tuple(full[i : i + size]) == block.token_ids for i in range(0, len(full) - size + 1, size))
    # A later request with that whole text hits the cache for all its full blocks and continues identically.
    again = engine.generate([full[:-1]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    assert again[0][0].token_ids == [full[-1]]
    assert engine.block_manager.num_hit_tokens >= (len(full) - 1) // size * size


def test_abort_and_max_tokens_with_speculation(llama: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine = llama.engine(speculative=NGRAM)
    outputs = engine.generate([[5, 6, 7, 8] * 6] * 3, params)
    assert all(len(c[0].token_ids) == 3 and c[0].finish_reason == "length" for c in outputs)
    engine.add_request("a", [5, 6, 7, 8] * 6, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    final = engine.abort_request("a")
    assert final is not None and final.finished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculation_turns_off_above_the_batch_threshold(llama: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = llama.engine(speculative={**NGRAM, "max_num_seqs": 2})
    engine.generate([[5, 6, 7, 8] * 6] * 3, params)
    assert engine.stats()["spec_proposed_tokens_total"] == 0


# -- the distribution -------------------------------------------------------------------------------------------


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target's sampling distribution, computed independently of the sampler."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    top = probs[order[:top_k]] / probs[order[:top_k]].sum()  # top-k first, then top-p over what remains
    kept = 0
    while kept < top_k and (kept == 0 or float(top[:kept].sum()) < top_p):
        kept += 1
    out = torch.zeros_like(probs)
    out[order[:kept]] = probs[order[:kept]]
    return out / out.sum()


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square(counts: Counter[int], probs: torch.Tensor, num: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens with expected count >= 5 (the rest pooled), and its degrees of freedom."""
    expected = probs * num
    support = [t for t in range(len(probs)) if float(expected[t]) >= 5]
    assert sum(counts[t] for t in range(len(probs)) if float(probs[t]) == 0) == 0, "a token outside the support"
    stat = sum((counts[t] - float(expected[t])) ** 2 / float(expected[t]) for t in support)
    rest_expected = num - sum(float(expected[t]) for t in support)
    rest = num - sum(counts[t] for t in support)
    if rest_expected >= 5:
        stat += (rest - rest_expected) ** 2 / rest_expected
        return stat, len(support)
    return stat, len(support) - 1


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (1.5, 12, 0.9)])
def test_verified_tokens_follow_the_target_distribution(
    llama: Any, temperature: float, top_k: int, top_p: float
) -> None:
    """3000 unseeded samples, each proposing two fixed tokens after the first: the second and
    third tokens (picked by verification rows when the proposals match, by a plain step otherwise) follow the
    target's exact marginals, computed from transformers' processed softmax over every prefix (chi-square,
    p = 0.001)."""
    prompt = [3, 17, 29, 41, 53]

    def probs_after(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = llama.hf(torch.tensor([[*prompt, *p] for p in prefixes])).logits[:, -1]
        return torch.stack([processed_probs(row, temperature, top_k or VOCAB, top_p) for row in logits])

    first = probs_after([[]])[0]
    given_first = probs_after([[t] for t in range(VOCAB)])  # [t0, t1]
    joint = first[:, None] * given_first
    pairs = [(a, b) for a, b in (joint > 1e-6).nonzero().tolist()]
    given_pair = probs_after([[a, b] for a, b in pairs])
    second = joint.sum(dim=0)
    third = sum(float(joint[a, b]) * row for (a, b), row in zip(pairs, given_pair, strict=True))
    proposal = [int(second.argmax()), int(third.argmax())]

    class Fixed(Proposer):
        def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
            return proposal[:num_tokens] if seq.num_output_tokens == 1 else []

    torch.manual_seed(0)
    num = 3000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4, ignore_eos=True)
    engine = llama.engine(speculative=NGRAM, max_num_seqs=256, max_num_batched_tokens=4096)
    engine.speculator.proposer = Fixed()
    outputs = [c[0].token_ids for c in engine.generate([prompt] * num, params)]
    assert engine.stats()["spec_accepted_tokens_total"] > 100
    for position, probs in ((1, second), (2, third)):
        stat, df = chi_square(Counter(o[position] for o in outputs), probs, num)
        assert stat < chi_square_critical(df), f"position {position}: chi-square {stat:.1f}, {df} degrees of freedom"


# -- visibility -------------------------------------------------------------------------------------------------


def test_usage_reports_speculation_only_when_it_ran() -> None:
    from backends.local_mapping import Usage

    usage = Usage()
    usage.add_prompt([RequestOutput("a", [], 10, finished=True)])
    assert "speculative" not in usage.as_dict()
    usage.add_prompt(
        [
            RequestOutput("b", [], 10),
            RequestOutput("b", [], 10, finished=True, num_spec_proposed=12, num_spec_accepted=7),
        ]
    )
    assert usage.as_dict()["speculative"] == {"proposed": 12, "accepted": 7}


def test_engine_counters_reach_prometheus(llama: Any) -> None:
    from types import SimpleNamespace

    from gateway.engine_metrics import EngineStatsCollector

    engine = llama.engine(speculative=NGRAM)
    engine.generate([[5, 6, 7, 8] * 6], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_method"] == "ngram" and stats["spec_proposed_tokens_total"] > 0
    assert llama.engine().stats()["spec_proposed_tokens_total"] == 0

    class Backend:
        def stats(self) -> dict[str, Any]:
            return {"name": "local", "loaded": True, **stats}

    collector = EngineStatsCollector()
    deployment = SimpleNamespace(config=SimpleNamespace(id="m"), backend=Backend())
    collector.router = SimpleNamespace(deployments=[deployment])  # type: ignore[assignment]
    samples = {s.name: s.value for metric in collector.collect() for s in metric.samples}
    assert samples["unigate_engine_spec_proposed_tokens_total"] == stats["spec_proposed_tokens_total"]
    assert samples["unigate_engine_spec_accepted_tokens_total"] == stats["spec_accepted_tokens_total"]


def test_bundled_model_greedy_is_unchanged(bundled_checkpoint: Any) -> None:
    """The bundled model asked to repeat a file (prompt lookup accepts much of it) and a question: the same greedy
    tokens with speculation on as off (off equals transformers: test_bundled_model.py)."""
    from pathlib import Path

    from local_engine.config import EngineConfig
    from local_engine.engine import LLMEngine

    tokenizer = bundled_checkpoint.tokenizer
    source = "\n".join(Path(__file__).read_text().splitlines()[30:50])
    messages = [f"Repeat this code exactly:\n\n```python\n{source}\n```", "What is the capital of France?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    options: dict[str, Any] = {"device": "cpu", "kv_cache_memory": 64 * 2**20, "max_num_seqs": 4}
    off = LLMEngine.from_checkpoint(bundled_checkpoint, EngineConfig(**options)).generate(prompts, params)
    engine = LLMEngine.from_checkpoint(bundled_checkpoint, EngineConfig(**options, speculative={"method": "ngram"}))
    on = engine.generate(prompts, params)
    assert [c[0].token_ids for c in on] == [c[0].token_ids for c in off]
    assert engine.stats()["spec_accepted_tokens_total"] > 10
