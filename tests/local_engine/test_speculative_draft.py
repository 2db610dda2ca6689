"""The `draft` proposer: a second model (a different tiny Llama loaded from its directory, or a cheaper copy of the
target) proposes, the target verifies; outputs equal decoding without speculation (greedy, seeded), sampled tokens
follow the target's distribution (rejection sampling with the draft's q), and the draft's own KV blocks come back."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes.tiny_models import COMMON, VOCAB, tiny_model
from test_speculative import LetterTokenizer, chi_square, chi_square_critical, choices, processed_probs

from local_engine.config import SpeculativeConfig
from local_engine.output_processor import RequestOutput, accumulate
from local_engine.sampler import Sampler
from local_engine.sampling_params import SamplingParams
from local_engine.sequence import Sequence, SequenceStatus

PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9] * 4, list(range(60, 75))]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the target's vocabulary but its own weights (one layer), saved as a Hugging Face
    directory with a word-level tokenizer over the same 160 ids."""
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(1)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    directory = tmp_path_factory.mktemp("draft-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0").save_pretrained(directory)
    return directory


def draft_options(kind: str, directory: Path) -> dict[str, Any]:
    base: dict[str, Any] = {"method": "draft", "max_num_seqs": 64, "num_tokens": 4}
    if kind == "other":  # a different model: low acceptance
        return {**base, "draft_model_path": str(directory)}
    if kind == "self-bf16":  # the target's own weights in bfloat16: high acceptance
        return {**base, "draft_dtype": "bfloat16"}
    return {**base, "draft_num_layers": 1}  # the target's first layer, then its norm and head


def run(engine: Any, params: list[SamplingParams], prompts: list[list[int]]) -> list[list[RequestOutput]]:
    """Every prompt to completion through `step()`, checking both block managers after every step."""
    deltas: dict[str, list[RequestOutput]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        deltas[f"r{i}"] = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None
            deltas[out.request_id].append(out)
        engine.block_manager.check_invariants(engine.scheduler.running)
        if engine.speculator is not None:
            draft = engine.speculator.proposer
            draft.block_manager.check_invariants([d.seq for d in draft.drafts.values()])
    return [deltas[f"r{i}"] for i in range(len(prompts))]


REQUESTS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, stop=("mno",), ignore_eos=True, n=2),
    SamplingParams(temperature=0.9, top_k=40, max_tokens=12, seed=7, ignore_eos=True, n=2, logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
]
# 8 blocks of 16 tokens (512 bytes a token): less than the requests need at once
SMALL_CACHE: dict[str, Any] = {"max_num_batched_tokens": 24, "max_num_seqs": 8, "kv_cache_memory": 8 * 8192}


@pytest.fixture(scope="module")
def reference() -> list[list[RequestOutput]]:
    """The requests without speculation, on the same small cache."""
    plain = tiny_model("llama3").engine(**SMALL_CACHE)
    plain.tokenizer = LetterTokenizer()
    return run(plain, REQUESTS, [*PROMPTS, PROMPTS[0][5:]])


@pytest.mark.parametrize("kind", ["other", "self-bf16"])
def test_outputs_equal_decoding_without_speculation(
    llama: Any, other_llama_dir: Path, reference: list[list[RequestOutput]], kind: str
) -> None:
    """Four requests at once (one with a stop string, two with n = 2, one seeded), prompts prefilled in chunks of
    24 tokens, and KV caches so small that sequences get preempted and restart (the draft's too): the same tokens,
    text, finish reasons and logprobs as without speculation, and every draft block back at the end. The bfloat16
    draft (slow on a CPU without bfloat16 kernels) runs the first two requests only: outputs do not depend on the
    batch, so they still equal the reference."""
    num = len(REQUESTS) if kind == "other" else 2
    requests, reference = REQUESTS[:num], reference[:num]
    engine = llama.engine(**SMALL_CACHE, speculative=draft_options(kind, other_llama_dir))
    engine.tokenizer = LetterTokenizer()
    deltas = run(engine, requests, [*PROMPTS, PROMPTS[0][5:]][:num])
    assert [choices([d], p.n) for d, p in zip(deltas, requests, strict=True)] == [
        choices([d], p.n) for d, p in zip(reference, requests, strict=True)
    ]
    stats = engine.stats()
    assert stats["spec_method"] == "draft" and stats["spec_proposed_tokens_total"] > 0
    if kind == "other":
        assert stats["num_preemptions_total"] > 0
    else:  # several tokens arrive in one delta
        assert stats["spec_acceptance_rate"] > 0.5
        assert any(len(c.token_ids) > 1 for d in deltas for out in d for c in out.outputs)
    assert stats["spec_draft_kv_blocks_free"] == stats["spec_draft_kv_blocks_total"] == engine.capacity.num_blocks
    assert engine.speculator.proposer.drafts == {}
    for got, want, p in zip(deltas, reference, requests, strict=True):
        for x, y in zip(accumulate(got, p.n), accumulate(want, p.n), strict=True):
            if p.logprobs:
                assert x.logprobs is not None and y.logprobs is not None
                torch.testing.assert_close(
                    torch.tensor([lp.logprob for lp in x.logprobs]), torch.tensor([lp.logprob for lp in y.logprobs])
                )


def test_abort_mid_stream_returns_the_draft_blocks(llama: Any) -> None:
    """An early-exit draft (the target's first layer): a request aborted mid-stream gives its draft blocks back at
    once, the other finishes with the output it has without speculation, and then every draft block is free."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [[expected]] = llama.engine().generate([PROMPTS[1]], params)
    engine = llama.engine(speculative=draft_options("self-layers", Path()))
    draft = engine.speculator.proposer
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    deltas: list[RequestOutput] = []
    while len(draft.drafts) < 2:
        deltas += engine.step()
    [seq_a] = engine.requests["a"].seqs
    used = draft.block_manager.num_used_blocks
    assert len(draft.drafts[seq_a.seq_id].seq.block_table) > 0
    final = engine.abort_request("a")
    assert final is not None and final.outputs[0].finish_reason == "abort"
    assert seq_a.seq_id not in draft.drafts
    assert draft.block_manager.num_used_blocks < used
    while engine.has_unfinished_requests:
        deltas += engine.step()
    assert accumulate([d for d in deltas if d.request_id == "b"], 1)[0].token_ids == expected.token_ids
    assert engine.stats()["spec_proposed_tokens_total"] > 0
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    engine.reset()  # a failed step's recovery: the draft forgets everything too
    assert draft.drafts == {}


def test_the_next_proposal_does_not_depend_on_the_drafts_history(llama: Any) -> None:
    """Whatever the draft computed before (a partly rejected proposal, a step that decoded without verifying and
    happened to pick the first proposed token, a fully accepted proposal), its next proposal is that of a fresh
    draft on the same tokens, and forgetting the sequence frees every draft block."""
    spec = {**draft_options("self-layers", Path()), "num_tokens": 3}
    draft = llama.engine(speculative=spec).speculator.proposer
    seq = Sequence("r", PROMPTS[0], SamplingParams(temperature=0.0), max_tokens=60)
    seq.status = SequenceStatus.RUNNING

    def propose() -> list[int]:
        [proposal] = draft.propose_batch([seq], [3])
        draft.block_manager.check_invariants([d.seq for d in draft.drafts.values()])
        [fresh] = llama.engine(speculative=spec).speculator.proposer.propose_batch([seq], [3])
        assert proposal == fresh and len(proposal) == 3
        return proposal

    proposal = propose()
    seq.token_ids += [proposal[0], (proposal[1] + 1) % VOCAB]  # one accepted, then the target's own token
    draft.rollback(seq)
    proposal = propose()
    seq.token_ids.append(proposal[0])  # a plain decode step (no verification) that picked the first proposal
    proposal = propose()
    seq.token_ids += [*proposal, 9]  # all accepted, then the target's token
    draft.rollback(seq)
    propose()
    draft.forget(seq)
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks


def test_a_draft_must_fit_the_target() -> None:
    with pytest.raises(ValueError, match="draft_dtype"):
        SpeculativeConfig(method="draft")
    SpeculativeConfig(method="draft", draft_dtype="bfloat16")


def test_draft_with_another_vocabulary_or_too_many_layers_is_refused(llama: Any, other_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="draft_num_layers"):
        llama.engine(speculative={"method": "draft", "draft_num_layers": 3})
    config = other_llama_dir / "config.json"
    original = config.read_text()
    try:
        config.write_text(original.replace(f'"vocab_size": {VOCAB}', f'"vocab_size": {VOCAB + 8}'))
        with pytest.raises(ValueError, match="vocabulary"):
            llama.engine(speculative=draft_options("other", other_llama_dir))
    finally:
        config.write_text(original)


# -- the distribution -------------------------------------------------------------------------------------------


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """6000 one-token proposals drawn from q = [.1, .1, .8]: verification against p = [.5, .3, .2] accepts
    sum(min(p, q)) = 40% of them, and the first token (accepted proposal or residual draw) follows p."""
    torch.manual_seed(0)
    num = 6000
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.1, 0.1, 0.8])
    seqs = []
    for token in torch.multinomial(q, num, replacement=True).tolist():
        seq = Sequence("r", [1, 2], SamplingParams(temperature=1.0), max_tokens=4)
        seq.spec_token_ids = [token]
        seqs.append(seq)
    logits = p.log().repeat(2 * num, 1)  # rows: each sequence's proposal row, then its bonus row
    out = Sampler().verify(logits, seqs, [q[None, :]] * num)
    first = [
        accepted[0] if accepted else token
        for accepted, token in zip(out.accepted_token_ids, out.token_ids, strict=True)
    ]
    acceptance = sum(len(a) for a in out.accepted_token_ids) / num
    assert abs(acceptance - 0.4) < 4 * math.sqrt(0.4 * 0.6 / num)
    stat, df = chi_square(Counter(first), p, num)
    assert stat < chi_square_critical(df)


def test_draft_sampled_tokens_follow_the_target_distribution(llama: Any) -> None:
    """600 unseeded samples with temperature 1, top-k 12 and top-p 0.9, an early-exit draft (the target's first of
    two layers: its q differs from p enough that about a quarter of the proposals are accepted) proposing two tokens
    after the first: the second and third tokens follow the target's exact marginals, computed from transformers'
    processed softmax over every prefix (chi-square, p = 0.001)."""
    temperature, top_k, top_p = 1.0, 12, 0.9
    prompt = [3, 17, 29, 41, 53]

    def probs_after(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = llama.hf(torch.tensor([[*prompt, *p] for p in prefixes])).logits[:, -1]
        return torch.stack([processed_probs(row, temperature, top_k, top_p) for row in logits])

    first = probs_after([[]])[0]
    given_first = probs_after([[t] for t in range(VOCAB)])
    joint = first[:, None] * given_first
    pairs = [(a, b) for a, b in (joint > 1e-6).nonzero().tolist()]
    given_pair = probs_after([[a, b] for a, b in pairs])
    second = joint.sum(dim=0)
    third = sum(float(joint[a, b]) * row for (a, b), row in zip(pairs, given_pair, strict=True))

    torch.manual_seed(0)
    num = 600
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4, ignore_eos=True)
    spec = {**draft_options("self-layers", Path()), "num_tokens": 2, "max_num_seqs": 256}
    engine = llama.engine(speculative=spec, max_num_seqs=256, max_num_batched_tokens=4096)
    rejection_sampled: list[int] = []  # sequences verified by rejection sampling with q, per step
    original = engine.sampler._rejection_sample

    def spy(*args: Any) -> Any:
        out = original(*args)
        rejection_sampled.append(len(out))
        return out

    engine.sampler._rejection_sample = spy
    outputs = [c[0].token_ids for c in engine.generate([prompt] * num, params)]
    assert sum(rejection_sampled) > num
    stats = engine.stats()
    assert 100 < stats["spec_accepted_tokens_total"] < stats["spec_proposed_tokens_total"] - 100
    for position, probs in ((1, second), (2, third)):
        stat, df = chi_square(Counter(o[position] for o in outputs), probs, num)
        assert stat < chi_square_critical(df), f"position {position}: chi-square {stat:.1f}, {df} degrees of freedom"


def test_the_settings_name_the_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.settings import Settings

    monkeypatch.setenv("UNIGATE_ENGINE__SPECULATIVE__METHOD", "draft")
    monkeypatch.setenv("UNIGATE_ENGINE__SPECULATIVE__DRAFT_MODEL_PATH", "/models/draft.gguf")
    monkeypatch.setenv("UNIGATE_ENGINE__SPECULATIVE__DRAFT_NUM_LAYERS", "12")
    speculative = Settings(_env_file=None).engine.engine_config().speculative  # type: ignore[call-arg]
    assert (speculative.method, speculative.draft_model_path) == ("draft", "/models/draft.gguf")
    assert (speculative.draft_dtype, speculative.draft_num_layers) == ("auto", 12)
