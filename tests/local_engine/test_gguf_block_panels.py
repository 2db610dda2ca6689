"""Decode projections on a GGUF checkpoint's own Q4_1 / Q8_0 blocks (`cpu_kernels.pack_block_weight`,
`linear.attach_block_panels`): the kernel dequantizes them on the fly to exactly the float32 weights the checkpoint
dequantizes to, so every result equals the float32 panels' bit for bit — one projection, the fused decoder's
hidden states, the engine's greedy tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine
from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.linear import PackedLinear
from local_engine.sampling_params import SamplingParams

TinyModel = Any  # tests/local_engine/conftest.py's tiny transformers models (fixtures `family`, `llama`)

needs_kernel = pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TYPES = {"Q4_1": GGMLQuantizationType.Q4_1, "Q8_0": GGMLQuantizationType.Q8_0}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def blocks_of(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, torch.Tensor]:
    """`weight` quantized as a GGUF writer would: (raw blocks [N, bytes], the float32 weight they dequantize to)."""
    raw = quantize(weight.detach().float().numpy(), TYPES[kind])
    return raw, torch.from_numpy(dequantize(raw, TYPES[kind]).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize(("num_out", "num_in"), [(100, 64), (48, 160), (7, 576), (130, 1536)])
def test_a_projection_equals_the_float32_panels_bit_for_bit(kind: str, num_out: int, num_in: int) -> None:
    generator = torch.Generator().manual_seed(num_out + num_in)
    raw, weight = blocks_of(torch.randn(num_out, num_in, generator=generator) * 0.1, kind)
    weight_format = cpu_kernels.BLOCK_FORMATS[kind]
    packed = cpu_kernels.pack_block_weight(raw, weight_format, num_in)
    panels = cpu_kernels.pack_linear_weight(weight)
    assert packed is not None and panels is not None and packed.dtype == torch.uint8
    assert packed.numel() < panels.numel() * 4 / 3  # 24 or 36 bytes per 32 weights, against 128
    bias = torch.randn(num_out, generator=generator)
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 33, 40):  # in-register row tiles (one or several), then chunked
        x = torch.randn(rows, num_in + 5, generator=generator)[:, 5:]  # rows apart, as a slice of a fused output
        for b in (None, bias):
            got = cpu_kernels.linear(x, packed, num_out, b, weight_format)
            assert got is not None and torch.equal(got, cpu_kernels.linear(x, panels, num_out, b))
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_block_panels_that_do_not_fit_are_refused() -> None:
    raw, _ = blocks_of(torch.randn(10, 64), "Q4_1")
    assert cpu_kernels.pack_block_weight(raw, cpu_kernels.WEIGHTS_Q4_1, 96) is None  # not that many blocks a row
    assert cpu_kernels.pack_block_weight(raw, cpu_kernels.WEIGHTS_F32, 64) is None
    packed = cpu_kernels.pack_block_weight(raw, cpu_kernels.WEIGHTS_Q4_1, 64)
    assert packed is not None
    x = torch.randn(2, 64)
    assert cpu_kernels.linear(x, packed, 10, None, cpu_kernels.WEIGHTS_Q8_0) is None  # packed as another format
    assert cpu_kernels.linear(x, packed, 10, None) is None  # not float32 panels
    assert cpu_kernels.linear(torch.randn(2, 32), packed, 10, None, cpu_kernels.WEIGHTS_Q4_1) is None


def quantized_engine(model: TinyModel, **overrides: Any) -> tuple[LLMEngine, LLMEngine]:
    """Two engines on the same float32 weights, those of `model` after a round trip through Q4_1 blocks (Q8_0 for
    the output embedding): one given the blocks, one not."""
    state_dict = {name: tensor.clone() for name, tensor in model.hf.state_dict().items()}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for name in list(state_dict):
        leaf = name.split(".")[-2]
        kind = "Q4_1" if leaf in PROJECTIONS else "Q8_0" if leaf in ("lm_head", "embed_tokens") else None
        if kind is not None:
            raw, state_dict[name] = blocks_of(state_dict[name], kind)
            blocks[name] = (kind, raw)
    options: dict[str, Any] = {"device": "cpu", "kv_cache_memory": 4 * 2**20, "max_num_seqs": 16, **overrides}
    config = ModelConfig.from_hf_config(model.hf_config)
    with_blocks = LLMEngine(config, EngineConfig(**options), dict(state_dict), block_weights=blocks)
    return with_blocks, LLMEngine(config, EngineConfig(**options), dict(state_dict))


def prefilled(engine: LLMEngine, prompts: list[list[int]]) -> tuple[Any, ...]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    return engine.runner.prepare(engine.scheduler.schedule())[:3]


@needs_kernel
def test_the_engine_keeps_the_blocks_and_its_results_do_not_change(family: TinyModel) -> None:
    blocks, plain = quantized_engine(family)
    num_layers = family.hf_config["num_hidden_layers"]
    assert blocks.runner.block_panels == {"Q4_1": 4 * num_layers, "Q8_0": 1}  # the fused q/k/v and gate/up too
    assert plain.runner.block_panels == {} and blocks.stats()["gguf_block_panels"] == blocks.runner.block_panels
    packed = [m for m in blocks.runner.model.modules() if isinstance(m, PackedLinear)]
    assert all(m.weight_format != cpu_kernels.WEIGHTS_F32 and m.panels.dtype == torch.uint8 for m in packed)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 160, (n,), generator=generator).tolist() for n in (5, 40, 17, 90)]
    # the fused decoder's hidden states, and the K and V it writes, bit for bit
    inputs = prefilled(blocks, prompts)
    assert blocks.runner.cpu_decoder is not None and torch.equal(
        blocks.runner.cpu_decoder.run(*inputs), plain.runner.cpu_decoder.run(*prefilled(plain, prompts))
    )
    assert torch.equal(blocks.runner.kv_cache, plain.runner.kv_cache)
    # the op-by-op forward on the block panels too (the logits' projection included)
    with torch.inference_mode():
        assert torch.equal(blocks.runner.model(*inputs), plain.runner.model(*inputs))
    for engine in (blocks, plain):
        while engine.has_unfinished_requests:
            engine.step()
    fresh_blocks, fresh_plain = quantized_engine(family, cpu_fused_decode=False)
    expected = [c[0].token_ids for c in fresh_plain.generate(prompts, GREEDY)]
    assert [c[0].token_ids for c in fresh_blocks.generate(prompts, GREEDY)] == expected
    assert [c[0].token_ids for c in blocks.generate(prompts, GREEDY)] == expected


@needs_kernel
def test_off_by_setting_and_for_mixed_types(llama: TinyModel) -> None:
    off, _ = quantized_engine(llama, cpu_gguf_blocks=False)
    assert off.runner.block_panels == {}
    assert all(
        m.weight_format == cpu_kernels.WEIGHTS_F32 for m in off.runner.model.modules() if isinstance(m, PackedLinear)
    )
    # a fused projection whose shards come in different types keeps float32 panels
    state_dict = {name: tensor.clone() for name, tensor in llama.hf.state_dict().items()}
    blocks = {}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        raw, state_dict[name] = blocks_of(state_dict[name], "Q4_1")
        blocks[name] = ("Q4_1", raw)
    raw, state_dict["model.layers.0.self_attn.v_proj.weight"] = blocks_of(
        state_dict["model.layers.0.self_attn.v_proj.weight"], "Q8_0"
    )
    blocks["model.layers.0.self_attn.v_proj.weight"] = ("Q8_0", raw)
    # and an untied output projection never takes the input embedding's blocks (llama3 here is untied)
    raw, state_dict["model.embed_tokens.weight"] = blocks_of(state_dict["model.embed_tokens.weight"], "Q8_0")
    blocks["model.embed_tokens.weight"] = ("Q8_0", raw)
    engine = LLMEngine(
        ModelConfig.from_hf_config(llama.hf_config),
        EngineConfig(device="cpu", kv_cache_memory=4 * 2**20),
        state_dict,
        block_weights=blocks,
    )
    assert not llama.hf_config["tie_word_embeddings"] and engine.runner.block_panels == {}
