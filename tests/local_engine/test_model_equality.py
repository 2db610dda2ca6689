"""Greedy outputs of our engine equal transformers' token for token on the same (tiny, random) weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from local_engine.sampling_params import SamplingParams
from local_engine.sequence import Sequence
from local_engine.speculative import Proposer

VOCAB = 160  # the tiny models' vocabulary (tests/local_engine/conftest.py)
TinyModel = Any

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def check_equal(model: TinyModel, batch: list[list[int]], outputs: list[list[int]], max_new: int = 12) -> None:
    for prompt, got in zip(batch, outputs, strict=True):
        assert got == model.hf_greedy(prompt, max_new), f"{model.name}: prompt of {len(prompt)} tokens differs"


class OracleProposer(Proposer):
    """Proposes transformers' own greedy continuation, with every third proposal's last token wrong: verification
    then sees full acceptances, partial ones and rejections (tiny random models rarely repeat themselves, so
    prompt lookup alone accepts little on them)."""

    def __init__(self, model: TinyModel, prompts: list[list[int]], max_new: int = 12) -> None:
        self.expected = {tuple(p): p + model.hf_greedy(p, max_new) for p in prompts}
        self.num_calls = 0

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        self.num_calls += 1
        full = self.expected[tuple(seq.prompt_token_ids)]
        proposal = full[len(seq.token_ids) : len(seq.token_ids) + num_tokens]
        if proposal and self.num_calls % 3 == 0:
            proposal[-1] = (proposal[-1] + 1) % VOCAB
        return proposal


@pytest.fixture(params=["off", "ngram", "oracle", "draft"])
def spec(request: pytest.FixtureRequest) -> str:
    """Each engine test runs without speculative decoding, with prompt lookup, with an oracle proposer, and with a
    draft model (the target's first layer: an early-exit draft with its own KV cache, right often enough to accept)."""
    return str(request.param)


def spec_engine(model: TinyModel, spec: str, batch: list[list[int]], **overrides: Any) -> Any:
    if spec == "draft":
        overrides["speculative"] = {"method": "draft", "draft_num_layers": 1, "max_num_seqs": 64}
    elif spec != "off":
        overrides["speculative"] = {"method": "ngram", "ngram_min": 1, "max_num_seqs": 64}
    engine = model.engine(**overrides)
    if spec == "oracle":
        engine.speculator.proposer = OracleProposer(model, batch)
    return engine


def check_speculated(engine: Any, spec: str) -> None:
    """Speculation really ran (and, with the oracle, accepted tokens) and left no block behind."""
    stats = engine.stats()
    if spec != "off":
        assert stats["spec_proposed_tokens_total"] > 0
    if spec == "oracle":
        assert stats["spec_accepted_tokens_total"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if spec == "draft":
        assert stats["spec_draft_kv_blocks_free"] == stats["spec_draft_kv_blocks_total"]


def test_logits_match_transformers(family: TinyModel) -> None:
    from local_engine.block_manager import BlockManager
    from local_engine.scheduler import Scheduler
    from local_engine.sequence import Sequence

    engine = family.engine()
    prompt = prompts([37])[0]
    seq = Sequence("r", prompt, GREEDY, max_tokens=1)
    scheduler = Scheduler(BlockManager(8, 16), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=100)
    scheduler.add(seq)
    logits = engine.runner.run(scheduler.schedule())
    with torch.no_grad():
        reference = family.hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], reference, rtol=1e-4, atol=1e-4)


def test_prefill_runs_the_last_layer_on_sampled_rows_only(family: TinyModel) -> None:
    """A prefill step sends every token through every layer's attention (their K and V are cached) but only the
    rows that sample through the last layer's o projection and MLP; the logits still equal transformers'."""
    from local_engine.block_manager import BlockManager
    from local_engine.scheduler import Scheduler
    from local_engine.sequence import Sequence

    engine = family.engine()
    layers = engine.runner.model.model.layers
    seen: dict[str, int] = {}

    def rows_into(name: str) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...]) -> None:
            seen[name] = args[0].shape[0]

        return hook

    hooks = [
        layers[0].mlp.register_forward_pre_hook(rows_into("first mlp")),
        layers[-1].self_attn.o_proj.register_forward_pre_hook(rows_into("last o_proj")),
        layers[-1].mlp.register_forward_pre_hook(rows_into("last mlp")),
    ]
    batch = prompts([37, 5, 20], seed=3)
    scheduler = Scheduler(BlockManager(16, 16), max_num_seqs=4, max_num_batched_tokens=128, max_model_len=100)
    for i, prompt in enumerate(batch):
        scheduler.add(Sequence(f"r{i}", prompt, GREEDY, max_tokens=1))
    logits = engine.runner.run(scheduler.schedule())
    for hook in hooks:
        hook.remove()
    assert seen == {"first mlp": 62, "last o_proj": 3, "last mlp": 3}
    with torch.no_grad():
        for row, prompt in zip(logits, batch, strict=True):
            reference = family.hf(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(row, reference, rtol=1e-4, atol=1e-4)


def test_chunk_that_samples_nothing(llama: TinyModel) -> None:
    """A step holding only the first chunk of a long prompt has no row to sample: the last layer runs on none."""
    from local_engine.block_manager import BlockManager
    from local_engine.scheduler import Scheduler
    from local_engine.sequence import Sequence

    engine = llama.engine()
    prompt = prompts([50])[0]
    scheduler = Scheduler(BlockManager(8, 16), max_num_seqs=1, max_num_batched_tokens=16, max_model_len=100)
    scheduler.add(Sequence("r", prompt, GREEDY, max_tokens=1))
    assert engine.runner.run(scheduler.schedule()).shape == (0, VOCAB)


def test_many_lengths_in_one_batch(family: TinyModel, spec: str) -> None:
    batch = prompts([1, 5, 16, 17, 40, 3, 64, 9])
    batch[4] = batch[4][:20] * 2  # a repeated prompt: prompt lookup has something to find
    engine = spec_engine(family, spec, batch)
    outputs = engine.generate(batch, GREEDY)
    check_equal(family, batch, [o[0].token_ids for o in outputs])
    check_speculated(engine, spec)


def test_with_prefix_caching_hits(family: TinyModel, spec: str) -> None:
    shared = prompts([40], seed=1)[0]
    batch = prompts([3, 20, 1], seed=2, prefix=shared)
    engine = spec_engine(family, spec, batch, max_num_seqs=1)  # one at a time: later requests hit the prefix
    outputs = engine.generate(batch, GREEDY)
    assert engine.block_manager.num_hit_tokens >= 2 * 32
    check_equal(family, batch, [o[0].token_ids for o in outputs])
    check_speculated(engine, spec)


def test_with_chunked_prefill(llama: TinyModel, spec: str) -> None:
    batch = prompts([50, 7, 33])
    engine = spec_engine(llama, spec, batch, max_num_batched_tokens=16, max_num_seqs=4)
    outputs = engine.generate(batch, GREEDY)
    check_equal(llama, batch, [o[0].token_ids for o in outputs])
    check_speculated(engine, spec)


def test_with_forced_preemption(family: TinyModel, spec: str) -> None:
    batch = prompts([30, 45, 20, 38, 25, 11])
    # 8 blocks of 16 tokens: six sequences of 40-60 tokens cannot all stay resident.
    bytes_per_block = 16 * 2 * 2 * 2 * (32 if family.name == "qwen3" else 16) * 4
    engine = spec_engine(family, spec, batch, kv_cache_memory=8 * bytes_per_block, max_num_batched_tokens=32)
    assert engine.capacity.num_blocks == 8
    outputs = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    check_equal(family, batch, [o[0].token_ids for o in outputs])
    check_speculated(engine, spec)


def test_eos_stops_and_is_reported(llama: TinyModel) -> None:
    engine = llama.engine()
    prompt = prompts([10])[0]
    expected = llama.hf_greedy(prompt, 12)
    eos = expected[4]
    engine.eos_token_ids = frozenset({eos})
    params = SamplingParams(temperature=0.0, max_tokens=12)
    [choice] = engine.generate([prompt], params)[0:1][0]
    assert choice.token_ids == expected[: expected.index(eos) + 1]
    assert choice.finish_reason == "stop"
    [choice] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 3
