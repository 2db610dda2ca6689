"""Decode CUDA graphs: capture sizes, padding, the GPU memory plan, and the profiling forward pass.

Capturing needs a GPU (the last test); everything a graph replays — static buffers, padding rows that write no KV
and attend to one token, block tables padded to the model's length — also runs eagerly on CPU (`capture=False`),
so the padding is checked here against the plain eager step, token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from local_engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from local_engine.model_runner import kv_cache_budget
from local_engine.sampling_params import SamplingParams

TinyModel = Any  # tests/local_engine/conftest.py's tiny transformers models (fixtures `family`, `llama`)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_capture_sizes_follow_vllm_shape_and_cover_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 63, 64, 65)] == [1, 4, 8, 8, 16, 64, 64, None]


def test_kv_budget_subtracts_others_weights_and_activation_peak() -> None:
    gib = 2**30
    budget = kv_cache_budget(
        total=80 * gib, free=60 * gib, reserved=17 * gib, allocated=16 * gib, activations_peak=2 * gib, utilization=0.9
    )
    # 72 GiB allowed; 3 GiB held by the CUDA context / other processes; 16 GiB weights; 2 GiB activations.
    assert budget == int(72 * gib) - 3 * gib - 16 * gib - 2 * gib
    # Memory torch reserved but does not use (its cache) is available to the KV cache.
    assert (
        kv_cache_budget(total=10, free=2, reserved=8, allocated=1, activations_peak=1, utilization=1.0)
        == 10 - 0 - 1 - 1
    )


def _padded_engine(model: TinyModel, sizes: list[int], **overrides: object):
    engine = model.engine(**overrides)
    runner = engine.runner
    runner.graphs = DecodeGraphs(
        runner.model,
        sizes=sizes,
        max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
        device=runner.device,
        capture=False,
    )
    return engine


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [8]])
def test_padded_decode_steps_match_eager_steps(family: TinyModel, sizes: list[int]) -> None:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (5, 40, 17)]
    expected = [c[0].token_ids for c in family.engine().generate(prompts, GREEDY)]
    engine = _padded_engine(family, sizes)
    calls = []
    run = engine.runner.graphs.run
    engine.runner.graphs.run = lambda *args: calls.append(args[0].shape[0]) or run(*args)  # type: ignore[method-assign]
    got = [c[0].token_ids for c in engine.generate(prompts, GREEDY)]
    assert got == expected
    assert calls and set(calls) <= {1, 2, 3}  # decode steps went through the padded path


def test_padding_rows_write_no_kv(llama: TinyModel) -> None:
    engine = _padded_engine(llama, [8])
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.step()  # prefill
    before = engine.runner.kv_cache.clone()
    engine.step()  # one decode token through an 8-row graph: 7 padding rows
    changed = (engine.runner.kv_cache != before).reshape(2, llama.hf_config["num_hidden_layers"], -1, 16, 2, 16)
    changed_slots = changed.any(dim=(0, 1, 4, 5)).nonzero().tolist()
    assert len(changed_slots) == 1  # exactly the decoded token's slot, in every layer


def test_dummy_forward_is_the_largest_step_and_restores_the_cache(llama: TinyModel) -> None:
    engine = llama.engine(max_num_batched_tokens=96, max_num_seqs=8)
    runner = engine.runner
    attached = runner.model.model.layers[0].self_attn.attn.k_cache
    logits = runner.dummy_forward()
    assert logits.shape == (8, llama.hf_config["vocab_size"]) and bool(torch.isfinite(logits).all())
    assert runner.model.model.layers[0].self_attn.attn.k_cache is attached
    assert runner.activations_peak_bytes is None  # only measured on a GPU
    assert runner.graphs is None  # CPU: no CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_give_the_eager_tokens_on_gpu(family: TinyModel) -> None:
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (5, 40, 17, 3, 60)]
    options = {"device": "cuda", "dtype": "float32", "kv_cache_memory": 64 * 2**20}
    eager = family.engine(**options, enforce_eager=True)
    graphs = family.engine(**options)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None and graphs.runner.graphs.is_captured
    expected = [c[0].token_ids for c in eager.generate(prompts, GREEDY)]
    assert [c[0].token_ids for c in graphs.generate(prompts, GREEDY)] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiling_pass_sizes_the_kv_cache_within_the_utilization_on_gpu(llama: TinyModel) -> None:
    engine = llama.engine(device="cuda", kv_cache_memory=None, gpu_memory_utilization=0.05, enforce_eager=True)
    runner = engine.runner
    _, total = torch.cuda.mem_get_info()
    assert runner.activations_peak_bytes is not None and runner.activations_peak_bytes > 0
    assert 0 < engine.capacity.num_bytes <= 0.05 * total
