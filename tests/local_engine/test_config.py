"""`EngineConfig`: the engine's run options, frozen and validated when built (no torch)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from local_engine.config import EngineConfig, ModelConfig

TINY = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize("block_size", [0, -16, 3, 24, 48])
def test_block_size_is_a_positive_power_of_two(block_size: int) -> None:
    with pytest.raises(ValidationError, match=r"block_size must be a positive power of two \(e.g. 16 or 32\)"):
        EngineConfig(block_size=block_size)
    assert EngineConfig(block_size=1).block_size == 1 and EngineConfig(block_size=256).block_size == 256


def test_every_running_sequence_can_decode_each_step() -> None:
    with pytest.raises(ValidationError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=16).max_num_batched_tokens == 16
    with pytest.raises(ValidationError, match="max_num_seqs must be a positive"):
        EngineConfig(max_num_seqs=0)


@pytest.mark.parametrize("share", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_is_a_share(share: float) -> None:
    with pytest.raises(ValidationError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=share)
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def test_sizes_are_positive_or_unset() -> None:
    with pytest.raises(ValidationError, match="kv_cache_memory must be a positive"):
        EngineConfig(kv_cache_memory=0)
    with pytest.raises(ValidationError, match="max_model_len must be a positive"):
        EngineConfig(max_model_len=0)


def test_a_validation_error_is_a_value_error() -> None:
    """Callers that caught the dataclass's ValueError keep working."""
    with pytest.raises(ValueError):
        EngineConfig(block_size=24)


def test_frozen_and_strict_about_names() -> None:
    config = EngineConfig()
    with pytest.raises(ValidationError):
        config.block_size = 32  # type: ignore[misc]
    with pytest.raises(ValidationError, match="blok_size"):
        EngineConfig(blok_size=32)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        EngineConfig(device="tpu")  # type: ignore[arg-type]
    assert hash(config) == hash(EngineConfig())


def test_auto_values_resolve_without_being_stored() -> None:
    config = EngineConfig(max_model_len=4096)
    assert config.resolved_device(is_cuda_available=False) == "cpu"
    assert config.resolved_dtype("cuda") == "bfloat16" and config.resolved_dtype("cpu") == "float32"
    assert config.resolved_attention_backend("cuda", is_triton_available=True) == "triton"
    assert config.resolved_max_model_len(ModelConfig.from_hf_config(TINY)) == 256
    assert config.device == "auto" and config.dtype == "auto" and config.max_model_len == 4096
    assert config.cpu_kv_cache_memory == 512 * 2**20  # the CPU default budget, not a setting
    assert "cpu_kv_cache_memory" not in EngineConfig.model_fields


def test_kv_cache_dtype_is_a_closed_choice_resolved_against_the_model_dtype() -> None:
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]
    assert EngineConfig().resolved_kv_cache_dtype("bfloat16") == "bfloat16"  # auto: the model dtype
    assert EngineConfig(kv_cache_dtype="int8").resolved_kv_cache_dtype("float32") == "int8"
    model = ModelConfig.from_hf_config(TINY)  # 1 layer, 2 KV heads, head dim 8
    assert model.kv_bytes_per_token("int8") == 2 * 1 * 2 * 8 and model.kv_scale_bytes_per_block("int8") == 2 * 2 * 4
    assert model.kv_scale_bytes_per_block("bfloat16") == 0
