"""`unigate kv-plan`: the KV-cache arithmetic, shown, for a model on a GPU.

    KV bytes per token  = 2 (K and V) × layers × kv_heads × head_dim × dtype bytes
                          (+ int8: 2 × layers × kv_heads × 4 bytes of scales per 16-token block, as unigate's
                          engine stores them)
    KV budget           = GPU memory × utilisation − weights
    max concurrency(L)  = floor(KV budget / (KV bytes per token × L))

The model's shape comes from a Hugging Face `config.json` (parameters counted exactly from `*.safetensors`
headers when they sit beside it), a GGUF file (metadata read with `gguf.GGUFReader`), or explicit numbers.
Activations, CUDA graphs and block rounding are not counted: keep headroom through the utilisation.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "KvPlan",
    "ModelShape",
    "format_bytes",
    "from_explicit",
    "from_gguf",
    "from_hf_config",
    "kv_bytes_per_token",
    "kv_scale_bytes_per_token",
    "load_shape",
    "parse_count",
    "parse_size",
    "plan",
    "render",
]

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8": 1,
    "int8": 1,
    "int4": 0.5,
}
_SIZE_UNITS = {
    "": 2**30,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    source: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None = None
    is_num_params_estimated: bool = False
    weights_bytes_stored: int | None = None  # bytes of the weights as stored in the file (quantised for GGUF)
    stored_dtype: str | None = None
    max_context: int | None = None


def parse_size(text: str) -> int:
    """`80GiB`, `24GB`, `512MiB`; a bare number is GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read memory size {text!r}: use e.g. 80GiB, 24GB or 512MiB (a bare number is GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_count(text: str) -> int:
    """`7B`, `135M`, `7e9`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if match is None:
        raise ValueError(f"cannot read parameter count {text!r}: use e.g. 7B, 135M or 7e9")
    return int(float(match.group(1)) * _COUNT_UNITS[match.group(2).lower()])


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(sorted(DTYPE_BYTES))}") from None


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


# unigate's int8 KV cache keeps a float32 scale per (block, KV head) for K and for V; blocks of 16 tokens by default
INT8_SCALE_BYTES = 4
INT8_BLOCK_SIZE = 16


def kv_scale_bytes_per_token(shape: ModelShape, kv_dtype: str) -> float:
    """An int8 cache's scales, spread over the tokens of a block; 0 for other dtypes."""
    if kv_dtype.lower() != "int8":
        return 0.0
    return 2 * shape.num_layers * shape.num_kv_heads * INT8_SCALE_BYTES / INT8_BLOCK_SIZE


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str) -> float:
    elements = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes(kv_dtype)
    return elements + kv_scale_bytes_per_token(shape, kv_dtype)


def from_explicit(
    num_layers: int,
    hidden_size: int,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    num_params: int | None = None,
) -> ModelShape:
    if num_heads is None:
        if head_dim is None:
            raise ValueError("give --heads (or --head-dim): the head dimension is hidden / heads")
        num_heads = hidden_size // head_dim
    head_dim = head_dim if head_dim is not None else hidden_size // num_heads
    return ModelShape(
        "explicit",
        "command line",
        num_layers,
        hidden_size,
        num_heads,
        num_kv_heads if num_kv_heads is not None else num_heads,
        head_dim,
        num_params,
    )


def _estimate_params(cfg: dict[str, Any], head_dim: int, num_heads: int, num_kv_heads: int) -> int | None:
    """Llama-style count: embeddings (+ untied head), attention, gated MLP (× experts), norms."""
    hidden, vocab, inter = cfg.get("hidden_size"), cfg.get("vocab_size"), cfg.get("intermediate_size")
    if not (isinstance(hidden, int) and isinstance(vocab, int) and isinstance(inter, int)):
        return None
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = 3 * hidden * inter * int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1)
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return int(embeddings + cfg["num_hidden_layers"] * per_layer + hidden)


_PACKED_DTYPES = frozenset({"U8", "I8"})  # raw bytes: quantised blocks, not one parameter per element
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True, slots=True)
class _Counted:
    num_params: int
    num_bytes: int
    dtype: str  # the dtype(s) the counted tensors are stored in, e.g. "float32"


def _safetensors_params(folder: Path, packed_bits: int | None = None) -> _Counted | None:
    """Parameters and bytes over the `*.safetensors` headers in a folder; None if there are none.

    A tensor name stored twice (unigate's weights cache keeps a GGUF's quantised blocks as raw bytes beside the
    dequantised weights, under the same names) counts once, as its unpacked copy. With `packed_bits` (a GPTQ / AWQ
    checkpoint's `quantization_config.bits`) each int32 of a `*.qweight` holds 32 / bits parameters, and its
    `qzeros`, `scales` and `g_idx` count as bytes only."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, dict[str, Any]] = {}
    for file in files:
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            seen = tensors.get(name)
            if seen is None or (seen["dtype"] in _PACKED_DTYPES and tensor["dtype"] not in _PACKED_DTYPES):
                tensors[name] = tensor
    dtypes = sorted({str(t["dtype"]) for t in tensors.values()})

    def params(name: str, tensor: dict[str, Any]) -> int:
        num_elements = math.prod(int(n) for n in tensor["shape"])
        if packed_bits is None:
            return num_elements
        if name.endswith(".qweight"):
            return num_elements * 32 // packed_bits
        return 0 if name.endswith((".qzeros", ".scales", ".g_idx")) else num_elements

    return _Counted(
        num_params=sum(params(name, t) for name, t in tensors.items()),
        num_bytes=sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values()),
        dtype="+".join(_SAFETENSORS_DTYPES.get(d, d.lower()) for d in dtypes),
    )


def from_hf_config(path: Path) -> ModelShape:
    config_path = path / "config.json" if path.is_dir() else path
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    cfg = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    try:
        num_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"{config_path} has no {exc.args[0]!r}: is it a transformer's config.json?") from None
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    quantized = raw.get("quantization_config")
    bits = quantized.get("bits") if isinstance(quantized, dict) else None
    counted = _safetensors_params(config_path.parent, bits if isinstance(bits, int) and 0 < bits <= 8 else None)
    num_params = counted.num_params if counted else _estimate_params(cfg, head_dim, num_heads, num_kv_heads)
    return ModelShape(
        name=str(raw.get("_name_or_path") or cfg.get("model_type") or config_path.parent.name),
        source=str(config_path),
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_params=num_params,
        is_num_params_estimated=counted is None,
        weights_bytes_stored=counted.num_bytes if counted else None,
        stored_dtype=(
            f"{quantized.get('quant_method', 'quantized')} {bits}-bit, packed"
            if isinstance(quantized, dict) and bits
            else raw.get("torch_dtype") or raw.get("dtype") or (counted.dtype if counted else None)
        ),
        max_context=cfg.get("max_position_embeddings"),
    )


def from_gguf(path: Path) -> ModelShape:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def field_value(key: str) -> Any:
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    arch = field_value("general.architecture")
    if not arch:
        raise ValueError(f"{path} has no general.architecture: is it a model GGUF?")
    num_layers, hidden = field_value(f"{arch}.block_count"), field_value(f"{arch}.embedding_length")
    num_heads = field_value(f"{arch}.attention.head_count")
    if not all(isinstance(v, int) for v in (num_layers, hidden, num_heads)):
        raise ValueError(f"{path} lacks {arch}.block_count / embedding_length / attention.head_count")
    num_kv_heads = field_value(f"{arch}.attention.head_count_kv") or num_heads
    head_dim = field_value(f"{arch}.attention.key_length") or hidden // num_heads
    file_type = field_value("general.file_type")
    stored_dtype = "gguf"
    if file_type is not None:
        from gguf import LlamaFileType

        try:
            stored_dtype = f"gguf {LlamaFileType(file_type).name.removeprefix('MOSTLY_')}"
        except ValueError:
            stored_dtype = f"gguf file_type {file_type}"
    return ModelShape(
        name=str(field_value("general.name") or path.stem),
        source=str(path),
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weights_bytes_stored=sum(int(t.n_bytes) for t in reader.tensors),
        stored_dtype=stored_dtype,
        max_context=field_value(f"{arch}.context_length"),
    )


def load_shape(model: str) -> ModelShape:
    path = Path(model)
    if not path.exists():
        raise ValueError(f"{model} does not exist: give a config.json, a model folder or a .gguf file")
    return from_gguf(path) if path.suffix == ".gguf" else from_hf_config(path)


@dataclass(slots=True)
class KvPlan:
    shape: ModelShape
    dtype: str
    kv_dtype: str
    weights_dtype: str  # a dtype name, or "file" for the bytes as stored
    weights_bytes: float | None
    kv_bytes_per_token: float
    gpu_memory_bytes: int | None
    utilization: float
    kv_budget_bytes: float | None
    contexts: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    shape: ModelShape,
    *,
    dtype: str = "fp16",
    kv_dtype: str | None = None,
    weights_dtype: str | None = None,
    gpu_memory_bytes: int | None = None,
    utilization: float = 0.9,
    contexts: list[int] | None = None,
) -> KvPlan:
    kv_dtype, weights_dtype = kv_dtype or dtype, weights_dtype or dtype
    if weights_dtype == "file":
        weights = float(shape.weights_bytes_stored) if shape.weights_bytes_stored is not None else None
    else:
        weights = shape.num_params * dtype_bytes(weights_dtype) if shape.num_params is not None else None
    per_token = kv_bytes_per_token(shape, kv_dtype)
    budget = None
    if gpu_memory_bytes is not None:
        budget = gpu_memory_bytes * utilization - (weights or 0.0)
    rows = []
    for context in contexts or [2048, 8192, 32768]:
        per_sequence = per_token * context
        max_seqs = None if budget is None else max(0, math.floor(budget / per_sequence))
        rows.append({"context": context, "kv_bytes_per_sequence": per_sequence, "max_concurrency": max_seqs})
    return KvPlan(
        shape, dtype, kv_dtype, weights_dtype, weights, per_token, gpu_memory_bytes, utilization, budget, rows
    )


def render(kv: KvPlan) -> list[str]:
    s = kv.shape
    lines = [
        f"model      {s.name}  ({s.source})",
        f"shape      layers {s.num_layers}, hidden {s.hidden_size}, heads {s.num_heads}, kv heads {s.num_kv_heads}, "
        f"head dim {s.head_dim}" + (f", max context {s.max_context}" if s.max_context else ""),
    ]
    if kv.weights_dtype == "file" and kv.weights_bytes is not None:
        stored = f" ({s.stored_dtype})" if s.stored_dtype else ""
        lines.append(f"weights    as stored{stored} = {format_bytes(kv.weights_bytes)}")
    elif kv.weights_bytes is not None and s.num_params is not None:
        approx = "≈ " if s.is_num_params_estimated else ""
        lines.append(
            f"weights    {approx}{s.num_params / 1e9:.3f} B params × {dtype_bytes(kv.weights_dtype):g} B "
            f"({kv.weights_dtype}) = {format_bytes(kv.weights_bytes)}"
        )
        if s.weights_bytes_stored is not None:
            stored = f", {s.stored_dtype}" if s.stored_dtype else ""
            lines.append(f"           (as stored in the file{stored}: {format_bytes(s.weights_bytes_stored)})")
    else:
        lines.append("weights    unknown: pass --params (e.g. 7B) to count them")
    scales = kv_scale_bytes_per_token(s, kv.kv_dtype)
    scale_terms = (
        f" + scales 2 × {s.num_layers} × {s.num_kv_heads} × {INT8_SCALE_BYTES} B / {INT8_BLOCK_SIZE} tokens"
        if scales
        else ""
    )
    lines.append(
        f"KV/token   2 (K,V) × {s.num_layers} layers × {s.num_kv_heads} kv heads × {s.head_dim} head dim × "
        f"{dtype_bytes(kv.kv_dtype):g} B ({kv.kv_dtype}){scale_terms} = {kv.kv_bytes_per_token:,.0f} B = "
        f"{format_bytes(kv.kv_bytes_per_token)}"
    )
    if kv.kv_budget_bytes is not None and kv.gpu_memory_bytes is not None:
        lines.append(
            f"KV budget  {format_bytes(kv.gpu_memory_bytes)} × {kv.utilization:g} − weights "
            f"{format_bytes(kv.weights_bytes or 0)} = {format_bytes(kv.kv_budget_bytes)} "
            f"= {max(0, math.floor(kv.kv_budget_bytes / kv.kv_bytes_per_token)):,} tokens"
        )
        if kv.kv_budget_bytes <= 0:
            lines.append("           the weights alone do not fit: use a smaller dtype, a bigger GPU or more GPUs")
    lines.append("")
    lines.append(f"{'context':>9}  {'KV per sequence':>16}  {'max concurrency':>16}")
    for row in kv.contexts:
        seqs = "-" if row["max_concurrency"] is None else f"{row['max_concurrency']:,}"
        beyond = "  (beyond the model's max context)" if s.max_context and row["context"] > s.max_context else ""
        lines.append(f"{row['context']:>9,}  {format_bytes(row['kv_bytes_per_sequence']):>16}  {seqs:>16}{beyond}")
    if kv.kv_budget_bytes is not None:
        lines.append("")
        lines.append(
            "max concurrency = floor(KV budget / (KV per token × context)); activations and block rounding not counted"
        )
    else:
        lines.append("")
        lines.append("pass --gpu-memory (e.g. 80GiB) for the maximum concurrency per context length")
    return lines
