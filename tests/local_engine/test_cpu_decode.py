"""Decode steps in one native call (`local_engine/cpu_decode.py`): the same hidden states and KV writes as the
model's op-by-op forward, bit for bit, for each family (qkv bias, q/k norm, rope scaling, tied or untied
embeddings); the same greedy tokens end to end; and the cases it leaves to the forward."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from local_engine.cpu_decode import CpuDecoder
from local_engine.kernels import cpu as cpu_kernels
from local_engine.sampling_params import SamplingParams

TinyModel = Any  # tests/local_engine/conftest.py's tiny transformers models (fixtures `family`, `llama`)

needs_kernel = pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _decode_batch(model: TinyModel, prompt_lens: list[int], **overrides: Any) -> tuple[Any, tuple[Any, ...]]:
    """An engine whose prompts are prefilled and have one token each, and the inputs of its next (decode) step."""
    engine = model.engine(**overrides)
    generator = torch.Generator().manual_seed(len(prompt_lens))
    for i, n in enumerate(prompt_lens):
        engine.add_request(str(i), torch.randint(3, 160, (n,), generator=generator).tolist(), GREEDY)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch.num_decode_seqs == len(prompt_lens)
    return engine, engine.runner.prepare(batch)[:3]


@needs_kernel
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("prompt_lens", [[7], [5, 40, 17], [33, 1, 64, 9, 120, 2, 48, 15]])
def test_hidden_states_and_kv_writes_equal_the_op_by_op_forward(
    family: TinyModel, prompt_lens: list[int], kv_cache_dtype: str
) -> None:
    """An int8 cache too: the same quantized bytes and scales (the C write is shared), the same attention."""
    engine, (input_ids, positions, meta) = _decode_batch(family, prompt_lens, kv_cache_dtype=kv_cache_dtype)
    runner = engine.runner
    assert runner.cpu_decoder is not None and runner.cpu_decoder.can_run(meta, len(prompt_lens))
    state = [runner.kv_cache] if runner.kv_scales is None else [runner.kv_cache, runner.kv_scales]
    before = [t.clone() for t in state]
    with torch.inference_mode():
        expected = runner.model(input_ids, positions, meta)
    expected_state = [t.clone() for t in state]
    assert not torch.equal(expected_state[0], before[0])  # the step wrote its tokens' K and V
    for t, old in zip(state, before, strict=True):
        t.copy_(old)
    got = runner.cpu_decoder.run(input_ids, positions, meta)
    assert torch.equal(got, expected)
    assert all(torch.equal(t, e) for t, e in zip(state, expected_state, strict=True))


@needs_kernel
def test_greedy_tokens_are_the_same_with_and_without_it(family: TinyModel) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (5, 40, 17, 90)]
    fused = family.engine()
    calls: list[int] = []
    run = fused.runner.cpu_decoder.run
    fused.runner.cpu_decoder.run = lambda *args: calls.append(args[0].shape[0]) or run(*args)  # type: ignore[method-assign]
    got = [c[0].token_ids for c in fused.generate(prompts, GREEDY)]
    plain = family.engine(cpu_fused_decode=False)
    assert plain.runner.cpu_decoder is None and fused.stats()["fused_cpu_decode"]
    assert got == [c[0].token_ids for c in plain.generate(prompts, GREEDY)]
    assert calls and max(calls) == len(prompts)  # the decode steps went through it


@needs_kernel
def test_batches_past_its_rows_and_mixed_steps_take_the_forward(llama: TinyModel) -> None:
    engine, (_, _, meta) = _decode_batch(llama, [5, 9, 3])
    small = CpuDecoder(engine.runner.model, cpu_kernels.load(), max_rows=2)  # type: ignore[arg-type]
    assert not small.can_run(meta, 3)
    assert CpuDecoder(engine.runner.model, cpu_kernels.load(), max_rows=3).can_run(meta, 3)  # type: ignore[arg-type]
    meta.num_decode_tokens = 2  # one of the rows a prefill token: a mixed step
    assert not engine.runner.cpu_decoder.can_run(meta, 3)


@pytest.mark.parametrize(
    "overrides",
    [
        {"cpu_fused_decode": False},
        {"cpu_kernels": False},
        {"pack_cpu_weights": False},
        {"dtype": "bfloat16"},
        {"kv_cache_dtype": "bfloat16"},  # the native decoder reads a float32 or an int8 cache
    ],
)
def test_off_where_it_does_not_apply(llama: TinyModel, overrides: dict[str, Any]) -> None:
    engine = llama.engine(**overrides)
    assert engine.runner.cpu_decoder is None and not engine.stats()["fused_cpu_decode"]
    got = engine.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(got[0][0].token_ids) == 3  # decodes op by op


@needs_kernel
def test_bfloat16_on_cpu_says_once_why_it_runs_on_the_torch_ops(
    llama: TinyModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        engine = llama.engine(dtype="bfloat16")
    assert engine.runner.ops_name == "torch_ops"  # not the native ops, which would hand every call back
    reasons = [r.getMessage() for r in caplog.records if "float32 only" in r.getMessage()]
    assert len(reasons) == 1 and reasons[0].startswith("bfloat16 on CPU"), caplog.text
