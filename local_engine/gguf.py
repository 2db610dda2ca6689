"""Reading a GGUF file into a Hugging Face config and state dict.

Metadata keys (`llama.block_count`, ...) become `config.json` keys; tensors are dequantized with the `gguf`
package and renamed to Hugging Face parameter names; llama.cpp's row permutation of Q/K for its rope layout is
undone. The tokenizer is built elsewhere (`local_engine.tokenizer.Tokenizer.from_gguf`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from local_engine.errors import CheckpointError
from local_engine.kernels.cpu import BLOCK_FORMATS

__all__ = ["GgufCheckpoint", "read_gguf", "unpermute_rope_rows"]

GGUF_MAGIC = b"GGUF"

# llama.cpp architecture name -> (HF model_type, HF architecture class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# `{arch}.<key>` -> HF config key
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

_TOKEN_ID_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

_END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


@dataclass(frozen=True)
class GgufCheckpoint:
    """What a GGUF file holds besides its tokenizer: float32 weights under HF names."""

    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    pre_tokenizer: str | None  # `tokenizer.ggml.pre`, e.g. "smollm"
    # the tensors in a quantization the native CPU kernel reads as stored (`cpu_kernels.BLOCK_FORMATS`), as stored:
    # HF name -> (type, uint8 [rows, bytes per row])
    blocks: dict[str, tuple[str, np.ndarray]] = dataclasses.field(default_factory=dict)


def read_gguf(path: Path) -> GgufCheckpoint:
    """Dequantize every tensor of `path` to float32 and build the matching HF config; the Q4_1 / Q8_0 tensors are
    also kept as stored (`GgufCheckpoint.blocks`, in the same pass: the native CPU kernel's decode panels are built
    from them, `layers/linear.py`, `attach_block_panels`)."""
    reader = _open_reader(path)
    metadata = _read_metadata(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = gguf_to_hf_config(metadata, tensor_names, path)
    state_dict: dict[str, torch.Tensor] = {}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name, path)
        weights = _dequantize(tensor, path)
        raw = np.asarray(tensor.data)
        keep = tensor.tensor_type.name in BLOCK_FORMATS and raw.ndim == 2 and raw.dtype == np.uint8
        # The llama architecture (which also carries Mistral) is permuted; Qwen files keep HF's row order.
        if metadata["general.architecture"] == "llama" and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            is_query = hf_name.split(".")[-2] == "q_proj"
            num_heads = config["num_attention_heads"] if is_query else config["num_key_value_heads"]
            weights = unpermute_rope_rows(weights, num_heads)
            raw = unpermute_rope_rows(raw, num_heads) if keep else raw
        state_dict[hf_name] = torch.from_numpy(weights)
        if keep:
            blocks[hf_name] = (tensor.tensor_type.name, np.array(raw))  # a copy: the file closes
    pre = metadata.get("tokenizer.ggml.pre")
    return GgufCheckpoint(
        hf_config=config,
        state_dict=state_dict,
        pre_tokenizer=pre if isinstance(pre, str) else None,
        blocks=blocks,
    )


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (its rope rotates adjacent pairs; HF rotates the two halves).

    llama.cpp wrote, per head, rows in the order (half, pair) -> (pair, half); we swap them back.
    """
    head_dim = weights.shape[0] // num_heads
    # [rows, *in] -> [heads, head_dim/2, 2, *in] -> [heads, 2, head_dim/2, *in] -> [rows, *in]
    grouped = weights.reshape(num_heads, head_dim // 2, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


def gguf_to_hf_config(metadata: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """An HF `config.json` dict from GGUF metadata (llama / qwen2 / qwen3 architectures)."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise CheckpointError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (supported: {supported}); "
            "use a Hugging Face directory of a Llama, Mistral, Qwen2 or Qwen3 model instead.",
            code="checkpoint_unsupported",
        )
    model_type, architecture = _ARCHITECTURES[arch]
    name = str(metadata.get("general.name", ""))
    if arch == "llama" and "mistral" in name.lower():
        # llama.cpp files Mistral under the llama architecture; only the name tells them apart.
        model_type, architecture = "mistral", "MistralForCausalLM"
    config: dict[str, Any] = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu"}
    for key, hf_key in _ARCH_KEYS.items():
        if f"{arch}.{key}" in metadata:
            config[hf_key] = metadata[f"{arch}.{key}"]
    for key, hf_key in _TOKEN_ID_KEYS.items():
        if key in metadata:
            config[hf_key] = metadata[key]
    # llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>); HF puts those in
    # generation_config.json, which a GGUF does not have, so they join eos_token_id as a list.
    end_ids = [metadata[key] for key in _END_TOKEN_KEYS if key in metadata]
    if end_ids and any(token_id != end_ids[0] for token_id in end_ids):
        config["eos_token_id"] = list(dict.fromkeys(end_ids))
    missing = [key for key in ("hidden_size", "num_hidden_layers", "num_attention_heads") if key not in config]
    if missing:
        raise CheckpointError(
            f"{path.name}: GGUF metadata lacks {', '.join(missing)}; the file is incomplete: download or convert it "
            "again.",
            code="checkpoint_corrupt",
        )
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))
    # attention.key_length is the explicit head size (Qwen3: 128 with hidden 1024 / 16 heads); llama files only
    # state the rope dimension, which equals head_dim there.
    config["head_dim"] = metadata.get(
        f"{arch}.attention.key_length",
        metadata.get(f"{arch}.rope.dimension_count", config["hidden_size"] // config["num_attention_heads"]),
    )
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    config["rope_scaling"] = _rope_scaling(metadata, arch, tensor_names, path)
    return config


def _rope_scaling(metadata: dict[str, Any], arch: str, tensor_names: set[str], path: Path) -> dict[str, Any] | None:
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            f"{path.name}: GGUF files with llama3-style rope scaling (rope_freqs.weight) are not supported; "
            "load the model's Hugging Face directory instead.",
            code="checkpoint_unsupported",
        )
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise CheckpointError(
        f"{path.name}: GGUF rope scaling {kind!r} is not supported (only linear); "
        "load the model's Hugging Face directory instead.",
        code="checkpoint_unsupported",
    )


def _open_reader(path: Path) -> Any:
    from gguf import GGUFReader

    with path.open("rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (it does not start with b'GGUF'); pass a .gguf file or a Hugging Face "
            "directory with config.json and *.safetensors.",
            code="checkpoint_corrupt",
        )
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, EOFError) as exc:
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it is probably truncated: "
            "download it again.",
            code="checkpoint_corrupt",
        ) from exc


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata by key; arrays are left as their length (the vocabulary is read elsewhere)."""
    from gguf import GGUFValueType

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            metadata[key] = len(field.data)
        elif field.types[0] == GGUFValueType.FLOAT32:
            # The file stores float32: 1e-5 arrives as 9.99999974e-06. Keep the short decimal the model was saved with.
            metadata[key] = float(str(np.float32(field.contents())))
        else:
            metadata[key] = field.contents()
    return metadata


def _hf_tensor_name(name: str, path: Path) -> str:
    block = _BLOCK_NAME.match(name)
    if block and block.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{block.group(1)}.{_BLOCK_TENSORS[block.group(2)]}.{block.group(3)}"
    single = _GLOBAL_NAME.match(name)
    if single and single.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[single.group(1)]}.{single.group(2)}"
    raise CheckpointError(
        f"{path.name}: unexpected GGUF tensor {name!r} for a Llama-family model; this file holds an architecture "
        "the local engine cannot run.",
        code="checkpoint_unsupported",
    )


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise CheckpointError(
            f"{path.name}: tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which cannot be "
            "dequantized here; use a file quantized as Q4_0/Q4_1/Q5_*/Q8_0/K-quants or F16/F32.",
            code="checkpoint_unsupported",
        ) from exc
    weights = weights.astype(np.float32, copy=False)
    if not weights.flags.writeable:
        # Unquantized tensors come back as views of the read-only memory map; own them so the file can close.
        weights = weights.copy()
    return weights
