"""Sampling: seeds reproduce, filters restrict the support, penalties and min_tokens act, logprobs are the model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from local_engine.sampler import Sampler
from local_engine.sampling_params import SamplingParams
from local_engine.sequence import Sequence

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def tokens(engine: Any, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[list[int]]]:
    return [[c.token_ids for c in choices] for choices in engine.generate(prompts, params)]


def test_seed_reproduces_and_differs_across_seeds(llama: Any) -> None:
    engine = llama.engine()
    params = SamplingParams(temperature=1.5, max_tokens=16, seed=1234, ignore_eos=True)
    first = tokens(engine, params)
    assert tokens(engine, params) == first
    # Seeded requests reproduce whatever else shares the batch.
    mixed = tokens(engine, [params, SamplingParams(temperature=1.0, max_tokens=5)], [PROMPTS[0], PROMPTS[1]])
    assert mixed[0] == first[0]
    other = tokens(engine, SamplingParams(temperature=1.5, max_tokens=16, seed=4321, ignore_eos=True))
    assert other != first


def test_seed_reproduces_under_preemption(llama: Any) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (30, 40, 35, 25)]
    roomy = tokens(llama.engine(), params, prompts)
    squeezed_engine = llama.engine(kv_cache_memory=7 * 16 * 2 * 2 * 2 * 16 * 4, max_num_batched_tokens=32)
    assert tokens(squeezed_engine, params, prompts) == roomy
    assert squeezed_engine.scheduler.num_preemptions > 0


def test_n_choices_share_the_prompt_and_differ(llama: Any) -> None:
    engine = llama.engine()
    prompt = list(range(3, 40))
    [choices] = engine.generate([prompt], SamplingParams(n=4, temperature=1.5, max_tokens=12, seed=3, ignore_eos=True))
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in choices)
    assert len({tuple(c.token_ids) for c in choices}) > 1
    assert engine.block_manager.num_hit_tokens >= 3 * 32  # three siblings reused the parent's two full blocks
    [again] = engine.generate([prompt], SamplingParams(n=4, temperature=1.5, max_tokens=12, seed=3, ignore_eos=True))
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]


def test_greedy_equivalents(llama: Any) -> None:
    engine = llama.engine()
    greedy = tokens(engine, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert tokens(engine, SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True)) == greedy
    assert tokens(engine, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10, ignore_eos=True)) == greedy
    assert tokens(engine, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10, ignore_eos=True)) == greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-38),  # overflows float32 logits when divided by
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-46),  # 0 in float32
        SamplingParams(temperature=0.5, repetition_penalty=1e-40),  # seen positive logits / 1e-40 = inf
        SamplingParams(temperature=1e-6, repetition_penalty=1e-30, top_p=1e-40, min_p=0.9),
    ],
    ids=["temperature-1e-38", "temperature-1e-6", "top-p-1e-46", "penalty-1e-40", "all-tiny"],
)
def test_tiny_values_still_draw_the_best_token_never_garbage(params: SamplingParams) -> None:
    """Values no API refuses but float32 cannot divide by: a NaN distribution draws token 0 every time. The best
    token (here 7, with 3 — a token the sequence already holds, so a penalty below 1 favours it — as the runner-up)
    must win instead: greedy-like, or the penalty's own favourite."""
    logits = torch.full((1, 50), -2.0)
    logits[0, 7], logits[0, 3] = 6.0, 5.0
    drawn = Sampler()(logits.repeat(50, 1), make_seqs([params] * 50, [[3]] * 50)).token_ids
    expected = {3, 7} if params.repetition_penalty < 1 else {7}
    assert set(drawn) <= expected and 0 not in drawn, drawn


def make_seqs(params: list[SamplingParams], outputs: list[list[int]]) -> list[Sequence]:
    seqs = []
    for p, out in zip(params, outputs, strict=True):
        seq = Sequence("r", [3], p, max_tokens=100, eos_token_ids=frozenset({0}))
        for t in out:
            seq.append_token(t)
        seqs.append(seq)
    return seqs


def test_top_k_limits_the_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    seqs = make_seqs([SamplingParams(temperature=5.0, top_k=2)] * 400, [[]] * 400)
    drawn = set(Sampler()(logits, seqs).token_ids)
    assert drawn == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(400, 1)
    seqs = make_seqs([SamplingParams(temperature=1.0, top_p=0.75)] * 400, [[]] * 400)
    assert set(Sampler()(logits, seqs).token_ids) == {0, 1}


def test_sampled_tokens_follow_the_distribution() -> None:
    """The exponential race draws token i with probability p_i (chi-square over 20,000 draws, seeded: the same
    draws every run); a token of probability 0 is never drawn."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    num = 20_000
    seqs = make_seqs([SamplingParams(temperature=1.0)] * num, [[]] * num)
    drawn = torch.tensor(Sampler()(probs.log()[None, :].repeat(num, 1), seqs).token_ids)
    counts = torch.bincount(drawn, minlength=5).double()
    assert counts[4] == 0
    expected = probs[:4].double() * num
    chi_square = float(((counts[:4] - expected) ** 2 / expected).sum())
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001


def sorted_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top-k then top-p over the whole row sorted, the probabilities renormalised over the top-k tokens."""
    out = logits.clone()
    for row in range(logits.shape[0]):
        values, order = logits[row].sort(descending=True)
        k = top_k[row] if 0 < top_k[row] < len(values) else len(values)
        probs = torch.softmax(values[:k], dim=-1)
        before = probs.cumsum(dim=0) - probs
        keep = int((before < top_p[row]).sum()) if top_p[row] < 1.0 else k
        out[row, order[keep:]] = float("-inf")
    return out


@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1, 3, 5, 12, 40]), st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1])),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([0.3, 1.0, 4.0, 12.0]),
    st.integers(0, 2**31),
)
def test_top_k_top_p_from_the_best_candidates_equals_the_whole_row_sorted(
    filters: list[tuple[int, float]], scale: float, seed: int
) -> None:
    """Read from the best few candidates when they decide every row, else from the sorted row: the same tokens
    kept either way, for flat and peaked rows (scale), top-k within and beyond the candidates."""
    torch.manual_seed(seed)
    logits = torch.randn(len(filters), 40) * scale
    sampler = Sampler()
    sampler.TOP_CANDIDATES = 4  # 40 tokens a row: both paths run
    seqs = make_seqs([SamplingParams(top_k=k, top_p=p) for k, p in filters], [[] for _ in filters])
    expected = sorted_top_k_top_p(logits, [k for k, _ in filters], [p for _, p in filters])
    assert torch.equal(sampler._top_k_top_p(logits, seqs).isinf(), expected.isinf())


def test_penalties_and_min_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, frequency_penalty=0.05),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(1,)),
    ]
    seqs = make_seqs(params, [[0], [0, 0, 0], [0], [3]])  # the prompt is [3]
    out = Sampler()(logits, seqs).token_ids
    assert out[0] == 1  # 3.0 - 1.0 < 2.9
    assert out[1] == 1  # 3.0 - 0.15 < 2.9
    assert out[2] == 1  # 3.0 / 2 < 2.9
    seqs[3].eos_token_ids = frozenset({0})
    assert Sampler()(logits[3:], seqs[3:]).token_ids == [2]  # EOS (0) and the stop token (1) are banned


def reference_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """OpenAI's presence/frequency penalties and HF's repetition penalty, written out token by token."""
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        for token in set(seq.output_token_ids):
            out[row, token] -= p.frequency_penalty * seq.output_token_ids.count(token) + p.presence_penalty
        for token in set(seq.token_ids):
            value = out[row, token]
            out[row, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    return out


@given(
    st.lists(
        st.tuples(st.sampled_from([1.0, 1.1, 2.0]), st.sampled_from([0.0, 0.5]), st.sampled_from([0.0, 0.25])),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4), min_size=1, max_size=6),
    st.integers(0, 2**31),
)
def test_penalties_kept_per_sequence_equal_a_reference_step_after_step(
    penalties: list[tuple[float, float, float]], steps: list[list[int]], seed: int
) -> None:
    """The repetition penalty's token set is kept per sequence and grown each step; every step's penalised logits
    equal the reference's, also after a sequence's output shrinks and after a batch leaves a sequence out."""
    torch.manual_seed(seed)
    params = [SamplingParams(repetition_penalty=r, presence_penalty=pp, frequency_penalty=f) for r, pp, f in penalties]
    seqs = make_seqs(params, [[] for _ in params])
    sampler = Sampler()
    for step, new_tokens in enumerate(steps):
        if step == 2 and seqs[0].output_token_ids:  # an output rewritten (as a rollback would): the set is rebuilt
            del seqs[0].token_ids[-1]
        for seq, token in zip(seqs, new_tokens, strict=False):
            seq.append_token(token)
        batch = seqs[step % 2 :] or seqs  # sometimes a sequence sits a step out
        logits = torch.randn(len(batch), 16) * 3
        torch.testing.assert_close(sampler._apply_penalties(logits, batch), reference_penalties(logits, batch))
    for seq in seqs:
        sampler.forget(seq)
    assert not sampler._seen


def test_logit_bias_shifts_only_its_rows_and_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((0, -0.5),)),  # 2.5 < 2.9: token 1 wins
        SamplingParams(temperature=0.0, logit_bias=((3, 100.0), (2, 1.0))),  # forced
        SamplingParams(temperature=0.0),  # untouched in the same batch
    ]
    assert Sampler()(logits.clone(), make_seqs(params, [[], [], []])).token_ids == [1, 3, 0]
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias=((1, 100.5),))
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias=((-1, 1.0),))


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, logprobs=0),
        SamplingParams(),
    ]
    out = Sampler()(logits, make_seqs(params, [[], [], []]))
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == int(logits[0].argmax())
    assert first.logprob == pytest.approx(float(expected[0].max()), abs=1e-5)
    assert [t for t, _ in first.top] == expected[0].topk(5).indices.tolist()
    second = out.logprobs[1]
    assert second is not None and second.top == []
    assert second.logprob == pytest.approx(float(expected[1, out.token_ids[1]]), abs=1e-5)
    assert out.logprobs[2] is None


def test_invalid_params_are_rejected() -> None:
    for bad in ({"top_p": 0.0}, {"temperature": -1}, {"n": 0}, {"logprobs": 21}, {"stop": ("",)}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
