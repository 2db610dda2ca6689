"""`kv_cache_dtype` end to end on tiny random Llamas: what fits, how far int8 moves the logits, and an int8 cache
through batching, chunked prefill, prefix caching, preemption and speculative rollback with every block freed."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from local_engine.engine import LLMEngine
from local_engine.kernels import cpu as cpu_kernels
from local_engine.sampling_params import SamplingParams
from local_engine.speculative import Proposer

TinyModel = Any  # tests/local_engine/conftest.py's tiny transformers models (fixture `llama`)

# The tiny Llama's logits (std ~2.3) move by at most this with an int8 KV cache (measured 0.32 for this seed; a
# bfloat16 cache moves them by 0.05): each K/V element is within half a step, max |x| / 254, of its block and head.
INT8_LOGITS_MAX_ERROR = 0.6

# The three paths an int8 cache takes on CPU: the fused native decoder, the native ops one by one, the torch ops.
CPU_PATHS = {
    "fused": {},
    "native_ops": {"cpu_fused_decode": False},
    "torch_ops": {"cpu_kernels": False},
}


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def _prompts(lengths: list[int], seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, 160, (n,), generator=generator).tolist() for n in lengths]


def _prefill_logits(model: TinyModel, prompts: list[list[int]], **overrides: Any) -> torch.Tensor:
    """The last-position logits of each prompt, prefilled in chunks of 32 tokens (later chunks read the earlier
    ones' K/V back from the cache), captured from the model runner."""
    engine = model.engine(max_num_batched_tokens=32, max_num_seqs=8, **overrides)
    run = engine.runner.run
    captured: dict[str, torch.Tensor] = {}

    def capture(batch: Any) -> torch.Tensor:
        logits = run(batch)
        done = [
            s
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if s.num_computed_tokens + n == len(s.token_ids)
        ]
        assert len(done) == logits.shape[0]
        captured.update((seq.request_id, row) for seq, row in zip(done, logits, strict=True))
        return logits

    engine.runner.run = capture  # type: ignore[method-assign]
    _run(engine, prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return torch.stack([captured[str(i)] for i in range(len(prompts))])


def test_int8_kv_moves_the_logits_by_a_bounded_amount(llama: TinyModel) -> None:
    prompts = _prompts([90, 7, 50], seed=3)
    exact = _prefill_logits(llama, prompts)
    int8 = _prefill_logits(llama, prompts, kv_cache_dtype="int8")
    bf16 = _prefill_logits(llama, prompts, kv_cache_dtype="bfloat16")
    int8_error = (int8 - exact).abs().max().item()
    assert 0 < int8_error <= INT8_LOGITS_MAX_ERROR
    assert (bf16 - exact).abs().max().item() < int8_error  # 2 bytes per element beat 1
    margins = exact.topk(2).values
    is_clear = margins[:, 0] - margins[:, 1] > 2 * int8_error  # top-1 cannot flip where the margin is wider
    assert torch.equal(int8.argmax(-1)[is_clear], exact.argmax(-1)[is_clear])


@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_int8_kv_through_chunking_prefix_cache_and_preemption_frees_every_block(llama: TinyModel, path: str) -> None:
    if path != "torch_ops" and not cpu_kernels.is_available():
        pytest.skip("the native CPU kernels do not build here")
    # 14 blocks of 16 tokens for six sequences of 5-6 blocks each (two of them shared): the scheduler must preempt.
    bytes_per_block = (
        16 * 2 * 2 * 2 * 16 + 2 * 2 * 2 * 4
    )  # 16 tokens x 2 (K, V) x layers x kv heads x head dim + scales
    engine = llama.engine(
        kv_cache_dtype="int8",
        kv_cache_memory=14 * bytes_per_block,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        **CPU_PATHS[path],
    )
    assert engine.block_manager.num_blocks == 14
    shared = _prompts([32], seed=5)[0]  # two full blocks every prompt starts with
    prompts = _prompts([9, 20, 3, 14, 25, 6], seed=6, prefix=shared)

    outputs = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    assert [len(tokens) for tokens in outputs] == [24] * 6
    assert all(0 <= t < 160 for tokens in outputs for t in tokens)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_cache_hit_rate > 0
    assert engine.block_manager.num_used_blocks == 0
    assert engine.runner.cpu_decoder is (None if path != "fused" else engine.runner.cpu_decoder)
    assert (engine.runner.cpu_decoder is not None) == (path == "fused")


class WrongLastProposer(Proposer):
    """Proposes the next tokens of a recorded continuation with the last one changed: every verification rejects
    at least one proposed token, so its K/V (already written, possibly growing a block's scale) is rolled back."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def propose(self, seq: Any, num_tokens: int) -> list[int]:
        done = len(seq.token_ids) - seq.num_prompt_tokens
        tokens = self.continuation[done : done + num_tokens]
        return [*tokens[:-1], (tokens[-1] + 1) % 160] if tokens else []


def test_int8_kv_with_speculative_rollback(llama: TinyModel) -> None:
    """Rejected proposals leave int8 entries (and possibly a grown scale) behind; later steps write over them and
    the sequence completes with every block freed."""
    prompt = _prompts([21], seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _run(llama.engine(kv_cache_dtype="int8"), [prompt], params)
    engine = llama.engine(kv_cache_dtype="int8", speculative={"method": "ngram", "num_tokens": 3})
    assert engine.speculator is not None
    engine.speculator.proposer = WrongLastProposer(plain[0])
    speculated = _run(engine, [prompt], params)
    stats = engine.stats()
    proposed, accepted = int(stats["spec_proposed_tokens_total"]), int(stats["spec_accepted_tokens_total"])
    assert 0 < proposed and accepted < proposed  # each verification rolled back at least one token
    assert len(speculated[0]) == 16 and engine.block_manager.num_used_blocks == 0
    assert speculated[0][0] == plain[0][0]  # the prefill's token, before any proposal


def test_stats_show_the_kv_dtype_bytes_per_token_and_what_fits(llama: TinyModel) -> None:
    stats = {dtype: llama.engine(kv_cache_dtype=dtype).stats() for dtype in ("auto", "bfloat16", "int8")}
    assert [stats[d]["kv_cache_dtype"] for d in stats] == ["float32", "bfloat16", "int8"]
    capacity = {d: s["capacity"] for d, s in stats.items()}
    # 2 (K, V) x 2 layers x 2 kv heads x 16 head dim x bytes, and int8's scales per block (32 bytes)
    assert [capacity[d]["bytes_per_token"] for d in capacity] == [512, 256, 128]
    assert capacity["int8"]["scale_bytes_per_block"] == 32 and capacity["auto"]["scale_bytes_per_block"] == 0
    tokens = {d: capacity[d]["num_tokens"] for d in capacity}
    assert tokens["bfloat16"] == 2 * tokens["auto"]
    assert 3.9 * tokens["auto"] <= tokens["int8"] < 4 * tokens["auto"]  # the scales take 32 of each 2080 bytes
    assert capacity["int8"]["max_concurrent_seqs"]["512"] == capacity["int8"]["num_blocks"] // 32
    assert all(s["memory_bytes"]["kv_cache"] <= 4 * 2**20 for s in stats.values())


def test_a_bad_value_stops_start_up_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.settings import InvalidSettingsError, load_settings

    monkeypatch.setenv("UNIGATE_ENGINE__KV_CACHE_DTYPE", "int4")
    with pytest.raises(InvalidSettingsError) as info:
        load_settings(_env_file=None)
    assert str(info.value).startswith("UNIGATE_ENGINE__KV_CACHE_DTYPE=int4: Input should be 'auto', 'bfloat16'")
    monkeypatch.setenv("UNIGATE_ENGINE__KV_CACHE_DTYPE", "int8")
    assert load_settings(_env_file=None).engine.kv_cache_dtype == "int8"


def test_the_start_up_report_shows_the_kv_dtype_and_what_fits(
    llama: TinyModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        engine = llama.engine(kv_cache_dtype="int8", kv_cache_memory=2080 * 64)  # 64 blocks of 16 tokens
    [ready] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert engine.block_manager.num_blocks == 64
    # 2080 bytes per block / 16 tokens; 512-token sequences (the model's length) take 32 blocks
    assert (
        "KV cache int8 0 MiB (64 blocks x 16 tokens = 1024 tokens, 130 bytes per token, 2 sequences of 512 tokens)"
        in ready
    )
