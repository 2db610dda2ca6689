"""Engine configuration: what the model is (`ModelConfig`) and how the engine runs it (`EngineConfig`).

Both are frozen: components derive what they need (number of KV blocks, resolved device/dtype, the effective
maximum model length) and return it; nothing is written back here. No torch import: dtypes are names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["DTYPE_BYTES", "EngineConfig", "KVCapacity", "ModelConfig"]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from transformers-5 `rope_parameters` or the older `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3)")
    return theta, {"rope_type": rope_type, **scaling}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder shape shared by Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM2."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool  # Qwen2 always; Llama/Qwen3 when `attention_bias`
    has_o_bias: bool  # only Llama/Qwen3 with `attention_bias` (Qwen2 has none on o_proj)
    has_qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; rejects what this engine would compute wrongly."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported by the local engine "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        attention_bias = bool(hf.get("attention_bias", False))
        theta, scaling = _rope(hf)
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            has_qkv_bias=model_type == "qwen2" or attention_bias,
            has_o_bias=model_type != "qwen2" and attention_bias,
            has_qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class KVCapacity:
    """What a KV cache of `num_blocks` blocks holds; reported at start-up and in stats."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def max_concurrent_seqs(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens fit at once (each needs ceil(len / block_size) blocks)."""
        return self.num_blocks // max(1, math.ceil(seq_len / self.block_size))

    def as_dict(self, seq_lens: tuple[int, ...] = (512, 2048)) -> dict[str, Any]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "bytes": self.num_bytes,
            "bytes_per_token": self.bytes_per_token,
            "max_concurrent_seqs": {str(n): self.max_concurrent_seqs(n) for n in seq_lens},
        }


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. `auto` values are resolved by `resolved_*` methods, never stored back."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = a fraction of free device memory (GPU) or CPU default
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_memory: int = 512 * 1024 * 1024  # default KV budget on CPU when kv_cache_memory is None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = False  # True: no decode CUDA graphs (they need a GPU and the Triton backend anyway)
    pack_cpu_weights: bool = True  # CPU: projections through oneDNN on pre-packed weights (layers/linear.py)
    cpu_kernels: bool = True  # CPU: decode attention and rotary in the C kernels of layers/cpu_kernels.py
    cpu_fused_decode: bool = True  # CPU, with the above: a decode step's decoder stack in one native call
    # CPU, with cpu_kernels: decode-size projections read a GGUF checkpoint's Q4_1/Q8_0 blocks as stored (the same
    # float32 results, 5-6x fewer bytes per step) instead of float32 panels
    cpu_gguf_blocks: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @classmethod
    def from_settings(cls, settings: Any) -> EngineConfig:
        """From `gateway.settings.EngineSettings` (duck-typed so this module stays import-light)."""
        return cls(
            block_size=settings.block_size,
            kv_cache_memory=settings.kv_cache_memory,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            dtype=settings.dtype,
            device=settings.device,
            attention_backend=settings.attention_backend,
            enforce_eager=settings.enforce_eager,
            pack_cpu_weights=settings.pack_cpu_weights,
            cpu_kernels=settings.cpu_kernels,
            cpu_fused_decode=settings.cpu_fused_decode,
            cpu_gguf_blocks=settings.cpu_gguf_blocks,
        )

    def resolved_device(self, is_cuda_available: bool) -> str:
        if self.device == "auto":
            return "cuda" if is_cuda_available else "cpu"
        return self.device

    def resolved_dtype(self, device: str) -> str:
        """float32 on CPU, bfloat16 on GPU unless set."""
        if self.dtype == "auto":
            return "bfloat16" if device == "cuda" else "float32"
        return self.dtype

    def resolved_attention_backend(self, device: str, is_triton_available: bool) -> str:
        if self.attention_backend == "auto":
            return "triton" if device == "cuda" and is_triton_available else "torch"
        return self.attention_backend

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        if self.max_model_len is None:
            return model.max_position_embeddings
        return min(self.max_model_len, model.max_position_embeddings)
