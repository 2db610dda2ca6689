"""Engine configuration: what the model is (`ModelConfig`) and how the engine runs it (`EngineConfig`).

Both are frozen: components derive what they need (number of KV blocks, resolved device/dtype, the effective
maximum model length) and return it; nothing is written back here. No torch import: dtypes are names.

`EngineConfig` is a pydantic model so its checks run wherever it is built: the gateway's `EngineSettings` extends it
(every run option is declared once, here), so a bad `UNIGATE_ENGINE__*` value stops start-up with the variable's
name instead of failing the model load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from local_engine.errors import ModelLoadError

__all__ = [
    "DTYPE_BYTES",
    "KV_SCALE_BYTES",
    "EngineConfig",
    "KVCapacity",
    "ModelConfig",
    "ModelOptions",
    "SpeculativeConfig",
]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = 4  # an int8 KV cache's float32 scale per (block, KV head), for K and for V


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
        raise ModelLoadError(f"rope scaling {rope_type!r} is not supported (supported: default, linear, llama3)")
    return theta, {"rope_type": rope_type, **scaling}


def _sliding_window(hf: dict[str, Any], model_type: str, num_layers: int) -> int | None:
    """The attention window of a checkpoint that uses one (transformers' rule: a token attends to the previous
    `sliding_window` tokens, itself included), else None. Mistral applies `sliding_window` to every layer; Qwen2/3
    only with `use_sliding_window`, to the layers `layer_types` (or `max_window_layers`) marks."""
    window = hf.get("sliding_window")
    if window is None or model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            is_used = "sliding_attention" in layer_types
        else:
            is_used = int(hf.get("max_window_layers", num_layers)) < num_layers
        if not (hf.get("use_sliding_window") and is_used):
            return None
    return int(window)


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
    # Sliding-window attention (Mistral v0.1); the engine attends to the whole context, so it serves at most this
    # many tokens (`EngineConfig.resolved_max_model_len`), where both attentions agree.
    sliding_window: int | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict; rejects what this engine would compute wrongly."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported by the local engine "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        if hf.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=True is not supported")
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
            sliding_window=_sliding_window(hf, model_type, int(hf["num_hidden_layers"])),
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[dtype]

    def kv_scale_bytes_per_block(self, dtype: str) -> int:
        """An int8 KV cache's scales: 2 (K and V) × layers × kv_heads × 4 bytes per block; none for float dtypes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * KV_SCALE_BYTES if dtype == "int8" else 0


@dataclass(frozen=True)
class KVCapacity:
    """What a KV cache of `num_blocks` blocks holds; reported at start-up and in stats."""

    num_blocks: int
    block_size: int
    bytes_per_token: int  # the cache's own elements; an int8 cache adds `scale_bytes_per_block`
    kv_dtype: str = "float32"
    scale_bytes_per_block: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token + self.num_blocks * self.scale_bytes_per_block

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
            "kv_dtype": self.kv_dtype,
            "scale_bytes_per_block": self.scale_bytes_per_block,
            "max_concurrent_seqs": {str(n): self.max_concurrent_seqs(n) for n in seq_lens},
        }


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class SpeculativeConfig(BaseModel):
    """Speculative decoding (`local_engine/speculative.py`): `UNIGATE_ENGINE__SPECULATIVE__<FIELD>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ngram: prompt lookup over the request's own prompt and output; draft: a draft model (`local_engine/draft.py`)
    method: Literal["off", "ngram", "draft"] = "off"
    num_tokens: int = Field(default=8, ge=1, le=16)  # k: the most tokens proposed per sequence and step
    # ngram: the longest repeated suffix is matched, comparing at most `ngram_max` tokens; a match shorter than
    # `ngram_min` proposes nothing
    ngram_max: int = Field(default=16, ge=1)
    ngram_min: int = Field(default=2, ge=1)
    # Speculate only while at most this many sequences run; a larger batch decodes normally.
    max_num_seqs: int = Field(default=4, ge=1)
    # draft: a checkpoint with the target's vocabulary (HF directory or .gguf); None = the target's own weights...
    draft_model_path: str | None = None
    # ...in this dtype ("auto": the target's; e.g. bfloat16 drafting for a float32 target)...
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # ...keeping only the first this many decoder layers (an early-exit draft); None = all of them
    draft_num_layers: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check_ngram(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if (
            self.method == "draft"
            and self.draft_model_path is None
            and self.draft_dtype == "auto"
            and self.draft_num_layers is None
        ):
            raise ValueError(
                "method=draft without draft_model_path drafts with the target's own weights: make that copy cheaper "
                "with draft_dtype (e.g. bfloat16) or draft_num_layers, or set draft_model_path"
            )
        return self


class ModelOptions(BaseModel):
    """The run options that belong to one model rather than to the host: its weights' quantization and speculative
    decoding. A gateway's `type: local` deployment may set these for itself (`backends.config.LocalModelOptions`
    extends this model with the model's other options); the rest of `EngineConfig` is the host's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Weight-only quantization at load time (local_engine/quantization.py): int8 symmetric per output channel,
    # int4 in groups of `quantization_group_size` along the input with a scale and a minimum per group
    quantization: Literal["none", "int8", "int4"] = "none"
    quantization_group_size: int = 32
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("quantization_group_size")
    @classmethod
    def _check_quantization_group_size(cls, value: int) -> int:
        if value <= 0 or value % 32:
            raise ValueError("quantization_group_size must be a positive multiple of 32 (e.g. 32, 64 or 128)")
        return value

    @classmethod
    def of(cls, options: Self) -> Self:
        """This model's fields alone, from an instance of it or of a subclass with more fields (e.g. the run
        options `EngineConfig.of(settings)` from the gateway's `EngineSettings`, without the gateway's fields)."""
        if type(options) is cls:
            return options
        return cls(**{name: getattr(options, name) for name in cls.model_fields})


class EngineConfig(ModelOptions):
    """How the engine runs a model: the run options, declared once (the gateway's `EngineSettings` extends this
    model with its own fields, so `UNIGATE_ENGINE__<FIELD>` reads each of these; `ModelOptions` holds those a
    deployment may set for itself). Validated when built, so a bad value stops start-up instead of the model load.
    `auto` values are resolved by `resolved_*` methods, never stored back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Not a setting: the KV budget on CPU when kv_cache_memory is None (docs/local-engine.md states it).
    cpu_kv_cache_memory: ClassVar[int] = 512 * 1024 * 1024

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # KV cache elements: auto = the model dtype; int8 = per-(block, KV head) float32 scales (docs/local-engine.md)
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "int8"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes; None = a fraction of free device memory (GPU) or the CPU default
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no decode CUDA graphs (they need a GPU and the Triton backend anyway)
    pack_cpu_weights: bool = True  # CPU: projections through oneDNN on pre-packed weights (layers/linear.py)
    cpu_kernels: bool = True  # CPU: decode attention and rotary in the C kernels of kernels/cpu/
    cpu_fused_decode: bool = True  # CPU, with the above: a decode step's decoder stack in one native call
    # CPU, with cpu_kernels: decode-size projections read a GGUF checkpoint's Q4_1/Q8_0 blocks as stored (the same
    # float32 results, 5-6x fewer bytes per step) instead of float32 panels
    cpu_gguf_blocks: bool = True
    # With quantized weights or an int8 KV cache: measure perplexity on the evaluation text at start-up against a
    # float32 copy, warn past +1% (int8) / +5% (int4) (local_engine/perplexity.py)
    quantization_check: bool = False

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if not _is_power_of_two(value):
            raise ValueError("block_size must be a positive power of two (e.g. 16 or 32)")
        return value

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_kv_cache_memory(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes (e.g. 2147483648), or unset")
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _check_gpu_memory_utilization(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], a share of GPU memory (e.g. 0.9)")
        return value

    @field_validator("max_num_seqs")
    @classmethod
    def _check_max_num_seqs(cls, value: int) -> int:
        if value <= 0:
            raise ValueError("max_num_seqs must be a positive number of sequences (e.g. 64)")
        return value

    @field_validator("max_num_batched_tokens")
    @classmethod
    def _check_max_num_batched_tokens(cls, value: int, info: ValidationInfo) -> int:
        max_num_seqs = info.data.get("max_num_seqs")  # absent when it failed its own check
        if max_num_seqs is not None and value < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({value}) must be >= max_num_seqs ({max_num_seqs}) so every running "
                "sequence can decode each step: raise it or lower max_num_seqs"
            )
        return value

    @field_validator("max_model_len")
    @classmethod
    def _check_max_model_len(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("max_model_len must be a positive number of tokens, or unset (the model's own)")
        return value

    def resolved_device(self, is_cuda_available: bool) -> str:
        if self.device == "auto":
            return "cuda" if is_cuda_available else "cpu"
        return self.device

    def resolved_dtype(self, device: str) -> str:
        """float32 on CPU, bfloat16 on GPU unless set."""
        if self.dtype == "auto":
            return "bfloat16" if device == "cuda" else "float32"
        return self.dtype

    def resolved_kv_cache_dtype(self, model_dtype: str) -> str:
        """The model dtype unless set."""
        return model_dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_attention_backend(self, device: str, is_triton_available: bool) -> str:
        if self.attention_backend == "auto":
            return "triton" if device == "cuda" and is_triton_available else "torch"
        return self.attention_backend

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        """`max_model_len` or the model's own, capped at a sliding window: past it full attention (what the engine
        computes) gives other tokens than the checkpoint was trained for."""
        length = model.max_position_embeddings if self.max_model_len is None else self.max_model_len
        length = min(length, model.max_position_embeddings)
        return length if model.sliding_window is None else min(length, model.sliding_window)
