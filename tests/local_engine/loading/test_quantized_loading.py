"""Quantized loading end to end: a tiny random Llama / Qwen2 written as an HF directory (and a GGUF) is loaded
with int8 and int4 weights, cached quantized, and served by the engine.

Bounds: the engine on quantized weights equals a float32 engine on the dequantized weights (the reference: the
same math without the quantized kernels) within 1e-4 and greedy token for token; against the float32 original its
logits stay within 3% (int8) / 25% (int4, groups of 64) of their range. Measured on these random weights
(initializer range 0.1): 1.1% and 12-16%; random weights amplify the error with their scale (0.02: 0.5% and 7%;
0.2: 2.6% and 41%), so these are checks that the right weights are used, not quality figures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from local_engine import quantization
from local_engine.block_manager import BlockManager
from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine
from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.linear import QuantizedLinear
from local_engine.loader import Checkpoint, load_checkpoint
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import Scheduler
from local_engine.sequence import Sequence
from local_engine.weights_cache import MARKER_FILE

from .tiny_checkpoints import save_tiny_tokenizer, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 40, 17, 90, 3, 77, 12], [200, 7], list(range(30, 70))]
RANGE_BOUND = {"int8": 0.03, "int4": 0.25}


def write_hf_dir(directory: Path, family: str, tied: bool) -> Path:
    # larger weights than the default 0.02 give peaked logits: no greedy ties between float rounding orders
    tiny_model(family, tie_word_embeddings=tied, initializer_range=0.1).save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


def engine_of(checkpoint: Checkpoint, **options: Any) -> LLMEngine:
    config = EngineConfig(**{"device": "cpu", "kv_cache_memory": 4 * 2**20, "max_num_seqs": 8, **options})
    return LLMEngine.from_checkpoint(checkpoint, config)


def prefill_logits(engine: LLMEngine) -> torch.Tensor:
    scheduler = Scheduler(BlockManager(32, 16), max_num_seqs=4, max_num_batched_tokens=256, max_model_len=200)
    for i, prompt in enumerate(PROMPTS):
        scheduler.add(Sequence(f"r{i}", prompt, GREEDY, max_tokens=1))
    return engine.runner.run(scheduler.schedule())


def dequantized(checkpoint: Checkpoint, group_size: int) -> Checkpoint:
    """The checkpoint with each quantized projection as the float32 weight it stands for (shards as stored)."""
    plain, weights = quantization.split_quantized(checkpoint.state_dict, group_size)
    state_dict = dict(plain)
    for name, weight in weights.items():
        if name != "lm_head" or not checkpoint.hf_config["tie_word_embeddings"]:
            state_dict[f"{name}.weight"] = quantization.dequantize(weight)
    config = dict(checkpoint.hf_config)
    if config["tie_word_embeddings"]:  # the quantized copy of the head is untied from the float embedding
        config["tie_word_embeddings"] = False
        state_dict["lm_head.weight"] = quantization.dequantize(weights["lm_head"])
    return Checkpoint(config, state_dict, checkpoint.tokenizer, checkpoint.source, 0.0, False)


@pytest.mark.parametrize(("family", "tied"), [("llama", False), ("qwen2", True)])  # qwen2: qkv biases
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_engine_serves_a_quantized_hf_directory(tmp_path: Path, family: str, tied: bool, method: str) -> None:
    source = write_hf_dir(tmp_path / "hf", family, tied)
    group_size = 64
    checkpoint = load_checkpoint(source, quantization=method, quantization_group_size=group_size)
    assert checkpoint.hf_config["unigate_quantization"] == {"method": method, "group_size": group_size}
    assert "model.layers.0.self_attn.q_proj.weight" not in checkpoint.state_dict
    assert checkpoint.state_dict["model.layers.0.self_attn.q_proj.qweight"].dtype == (
        torch.int8 if method == "int8" else torch.uint8
    )
    assert "lm_head.qweight" in checkpoint.state_dict and "model.embed_tokens.weight" in checkpoint.state_dict

    engine = engine_of(checkpoint, quantization=method, quantization_group_size=group_size)
    model = engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 4 * 2 + 1  # qkv, o, gate_up, down per layer, and the head
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    reference = engine_of(dequantized(checkpoint, group_size))
    original = engine_of(load_checkpoint(source))
    logits, expected, full = prefill_logits(engine), prefill_logits(reference), prefill_logits(original)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    spread = float(full.max() - full.min())
    assert float((logits - full).abs().max()) < RANGE_BOUND[method] * spread
    assert engine.runner.weights_bytes < (0.45 if method == "int8" else 0.35) * original.runner.weights_bytes
    if cpu_kernels.is_available():  # decode steps in the native fused decoder, on the block panels
        assert all(m.panels is not None and m.quantized is None for m in quantized)
        assert engine.runner.cpu_decoder is not None
    tokens = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert tokens == [c[0].token_ids for c in reference.generate(PROMPTS, GREEDY)]
    # the torch path (no native kernels): the reference's math, dequantizing per call
    torch_path = engine_of(checkpoint, quantization=method, quantization_group_size=group_size, cpu_kernels=False)
    linears = [m for m in torch_path.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.panels is None and m.quantized is not None for m in linears)
    torch.testing.assert_close(prefill_logits(torch_path), expected, rtol=1e-4, atol=1e-4)


def test_a_gguf_is_quantized_from_its_float_weights(tmp_path: Path, gguf_writer: Callable[..., Path]) -> None:
    source = gguf_writer(tiny_model("llama", tie_word_embeddings=True, initializer_range=0.1), "llama")
    plain = load_checkpoint(source, cache_dir=tmp_path / "cache")
    checkpoint = load_checkpoint(source, cache_dir=tmp_path / "cache", quantization="int4")
    assert checkpoint.blocks == {}  # the file's own blocks (none here: float tensors) never mix with ours
    for name, tensor in plain.state_dict.items():
        module = name.removesuffix(".weight")
        if f"{module}.qweight" in checkpoint.state_dict:
            weights = quantization.split_quantized(
                {k: v for k, v in checkpoint.state_dict.items() if k.startswith(f"{module}.")}, 32
            )[1]
            expected = quantization.quantize(tensor, quantization.QuantizationSpec("int4", 32))
            assert torch.equal(quantization.dequantize(weights[module]), quantization.dequantize(expected)), name
    engine = engine_of(checkpoint, quantization="int4")
    tokens = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert tokens == [c[0].token_ids for c in engine_of(dequantized(checkpoint, 32)).generate(PROMPTS, GREEDY)]


def test_a_restart_reads_the_quantized_weights_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_hf_dir(tmp_path / "hf", "llama", False)
    cache_dir = tmp_path / "cache"
    calls: list[str] = []
    quantize_state_dict = quantization.quantize_state_dict

    def counting(state_dict: dict[str, torch.Tensor], spec: quantization.QuantizationSpec, tied: bool) -> Any:
        calls.append(spec.tag)
        return quantize_state_dict(state_dict, spec, tied)

    monkeypatch.setattr(quantization, "quantize_state_dict", counting)
    first = load_checkpoint(source, cache_dir=cache_dir, quantization="int8")
    second = load_checkpoint(source, cache_dir=cache_dir, quantization="int8")
    assert (first.from_cache, second.from_cache, calls) == (False, True, ["int8"])  # the second did not quantize
    assert second.hf_config == first.hf_config and set(second.state_dict) == set(first.state_dict)
    for name, tensor in first.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name
    # another quantization is its own entry, and the first one stays
    other = load_checkpoint(source, cache_dir=cache_dir, quantization="int4", quantization_group_size=64)
    assert other.from_cache is False and calls == ["int8", "int4-g64"]
    assert len(list(cache_dir.glob(f"*/{MARKER_FILE}"))) == 2
    assert load_checkpoint(source, cache_dir=cache_dir, quantization="int8").from_cache is True
    # bfloat16 models keep the scales in float32
    bf16 = load_checkpoint(source, cache_dir=cache_dir, quantization="int8", dtype=torch.bfloat16)
    assert bf16.from_cache and bf16.state_dict["model.layers.0.mlp.down_proj.scales"].dtype == torch.float32
    assert bf16.state_dict["model.norm.weight"].dtype == torch.bfloat16
    # an edited checkpoint is quantized again
    (source / "config.json").write_text((source / "config.json").read_text() + "\n")
    assert load_checkpoint(source, cache_dir=cache_dir, quantization="int8").from_cache is False


def test_a_quantized_checkpoint_needs_its_group_size(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(write_hf_dir(tmp_path / "hf", "llama", False), quantization="int4")
    with pytest.raises(ValueError, match="group size 64"):
        engine_of(checkpoint, quantization="int4", quantization_group_size=64)
    with pytest.raises(ValueError, match="quantization must be"):
        load_checkpoint(tmp_path / "hf", quantization="int3")
    assert ModelConfig.from_hf_config(checkpoint.hf_config).hidden_size == 64  # the extra config key is harmless


def test_the_local_backend_loads_with_its_deployments_quantization(tmp_path: Path) -> None:
    """The path a `type: local` deployment takes (`backends.local.load_engine`): the setting reaches the loader
    (a cached quantized entry) and the engine (quantized projections)."""
    from backends.config import LocalEngineOptions
    from backends.local import LocalBackendConfig, load_engine

    source = write_hf_dir(tmp_path / "hf", "llama", False)
    options = {"device": "cpu", "kv_cache_memory": 4 * 2**20, "quantization": "int4", "quantization_group_size": 64}
    config = LocalBackendConfig("d", "m", tmp_path / "models", LocalEngineOptions(model_path=str(source), **options))
    engine = load_engine(config)
    try:
        linears = [m for m in engine.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 9 and {m.method for m in linears if m is not engine.engine.runner.model.lm_head} == {
            "int4"
        }
        assert engine.engine.runner.model.lm_head.method == "int8"  # the head stays int8 (quantization.HEAD_METHOD)
        assert engine.engine.stats()["quantization"] == "int4"  # what /admin/engine reports
    finally:
        engine.stop()
    assert len(list((tmp_path / "models").glob(f"*/{MARKER_FILE}"))) == 1
