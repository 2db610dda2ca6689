"""Native CPU kernels for the local engine (`cpu_kernels.c`), float32:

- paged decode attention reading the KV cache blocks in place, where the torch path copies every sequence's
  blocks out of the cache first (`torch_ops._gather`) and runs SDPA with a query length of one GQA group, which
  the CPU kernels handle poorly;
- paged prefill attention (causal, chunked prefill and cached prefixes included), flash-attention style on the
  CPU: each sequence's keys copied once per KV head, transposed, so that scores are register-tiled outer products
  (no horizontal sums), values read in place from the cache; torch's flash SDPA path gathers each sequence's
  blocks first and runs at about 60% of its speed here;
- rotary embedding on q and k in place, one pass instead of a dozen small torch ops per layer;
- projections on weights packed once into panels (`pack_linear_weight`) for decode batches and small prefill
  chunks: a stream of the weight at read bandwidth for a few rows and at the FMA units' rate for dozens, where
  oneDNN's and MKL's small-M paths reach about half of either (`layers/linear.py` calls it up to
  `linear.NATIVE_MAX_ROWS` rows). The panels may also hold a GGUF checkpoint's own Q4_1 or Q8_0 blocks
  (`pack_block_weight`), dequantized on the fly (in registers for a few rows, a chunk at a time in L1 beyond)
  to exactly the float32 weights the checkpoint dequantizes to: the same result bit for bit, from 5-6x fewer
  bytes streamed per decode step;
- RMSNorm with its residual add, silu-and-mul and the KV cache write, one pass over the data each, where the
  torch ops take several (and a fresh tensor per step) for each;
- the whole decoder stack of a decode step in one call (`DecoderWeights`, `Kernel.decode_layers`: the kernels
  above in one OpenMP region, used by `local_engine/cpu_decode.py`).

The kernels are compiled on first use with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native
-fopenmp`: AVX2 and FMA intrinsics) into `$XDG_CACHE_HOME/unigate/kernels` (default `~/.cache/...`), keyed by the
source, the compiler and the CPU, and loaded with ctypes (which releases the GIL during a call). Their OpenMP
runtime is torch's (same `libgomp.so.1`, already loaded), so they use torch's threads and add none. Where they
cannot be built (no compiler, not x86-64, no AVX2: the build fails and the reason is logged) or do not apply
(dtypes other than float32, shapes past their limits), the functions return None (or False for the in-place
ones) and the caller uses the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DecoderWeights",
    "apply_rotary",
    "is_available",
    "linear",
    "load",
    "pack_block_weight",
    "pack_linear_weight",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]

logger = logging.getLogger("unigate.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
_P = ctypes.c_void_p
_I = ctypes.c_int64
_PP = ctypes.POINTER(ctypes.c_void_p)

# Weight formats of the projection panels (`WEIGHTS_*` in cpu_kernels.c): float32, or a GGUF file's own blocks.
WEIGHTS_F32 = 0
WEIGHTS_Q4_1 = 1
WEIGHTS_Q8_0 = 2
BLOCK_FORMATS = {"Q4_1": WEIGHTS_Q4_1, "Q8_0": WEIGHTS_Q8_0}  # GGUF type name -> format
_BLOCK_BYTES = {WEIGHTS_Q4_1: 20, WEIGHTS_Q8_0: 34}  # bytes of one block of 32 weights in the GGUF file
_PANEL_BLOCK_BYTES = {WEIGHTS_Q4_1: 24, WEIGHTS_Q8_0: 36}  # bytes per block of 32 and output feature, packed


class DecoderWeights(ctypes.Structure):
    """`unigate_decoder_t`: a model's shape and, per layer, pointers to its weights (projections as panels) and KV
    cache views. Null arrays: no q/k norm, no qkv or o bias."""

    _fields_ = [
        *((name, _I) for name in ("num_layers", "hidden", "inter", "num_heads", "num_kv_heads", "head_dim")),
        ("block_size", _I),
        ("weight_format", _I),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _PP) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias")),
        *((name, _PP) for name in ("gate_up", "down", "k_cache", "v_cache")),
        ("final_norm", _P),
        ("cos_sin", _P),
    ]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "unigate" / "kernels"


def _cpu_signature() -> str:
    """The CPU model and feature flags: `-march=native` code built on one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(wanted[:2])


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [_compiler(), *FLAGS, str(SOURCE), "-o", str(built), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip()[-2000:] or f"{command[0]} exited with {result.returncode}")
        built.replace(target)  # atomic: concurrent builders (test workers) never load a half-written library


@dataclass(frozen=True)
class Kernel:
    decode: ctypes._CFuncPtr  # type: ignore[name-defined]
    rotary: ctypes._CFuncPtr  # type: ignore[name-defined]
    linear: ctypes._CFuncPtr  # type: ignore[name-defined]
    rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_and_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    store_kv: ctypes._CFuncPtr  # type: ignore[name-defined]
    max_heads: int
    max_group: int
    max_head_dim: int
    max_block_size: int
    panel_width: int  # output features per panel of a packed projection weight (`pack_linear_weight`)
    lanes: int  # floats per vector: 16 with AVX-512, else 8 (prefill attention takes head dims that are multiples)
    prefill: ctypes._CFuncPtr  # type: ignore[name-defined]
    decode_layers: ctypes._CFuncPtr  # type: ignore[name-defined]


@functools.cache
def load() -> Kernel | None:
    """The compiled kernel, built on first use; None (logged once) where it cannot be built."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(
            b"\0".join(s.encode() for s in (SOURCE.read_text(), version, " ".join(FLAGS), _cpu_signature()))
        ).hexdigest()[:16]
        target = _cache_dir() / f"cpu_kernels-{key}.so"
        if not target.exists():
            _build(target)
        torch.get_num_threads()  # torch (and its OpenMP runtime) is loaded first: the kernel shares it
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable, using the torch ops: %s", exc)
        return None
    decode = library.unigate_paged_decode_f32
    decode.argtypes = [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float]
    decode.restype = None
    rotary = library.unigate_rotary_f32
    rotary.argtypes = [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I]
    rotary.restype = None
    linear = library.unigate_linear_f32
    linear.argtypes = [_P, _I, _I, _P, ctypes.c_int, _I, _I, _P, _P]
    linear.restype = ctypes.c_int
    rms_norm = library.unigate_rms_norm_f32
    rms_norm.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, ctypes.c_float]
    rms_norm.restype = None
    silu_and_mul = library.unigate_silu_and_mul_f32
    silu_and_mul.argtypes = [_P, _I, _I, _I]
    silu_and_mul.restype = None
    store_kv = library.unigate_store_kv_f32
    store_kv.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I]
    store_kv.restype = None
    limits = [ctypes.c_int64() for _ in range(4)]
    library.unigate_cpu_kernels_limits(*(ctypes.byref(x) for x in limits))
    library.unigate_linear_panel_width.restype = ctypes.c_int64
    library.unigate_vector_lanes.restype = ctypes.c_int64
    widths = (library.unigate_linear_panel_width(), library.unigate_vector_lanes())
    prefill = library.unigate_paged_prefill_f32
    prefill.argtypes = [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float]
    prefill.restype = ctypes.c_int
    decode_layers = library.unigate_decode_layers_f32
    decode_layers.argtypes = [ctypes.POINTER(DecoderWeights), _I, _P, _P, _P, _P, _P, _P, _I, _P]
    decode_layers.restype = ctypes.c_int
    return Kernel(
        decode,
        rotary,
        linear,
        rms_norm,
        silu_and_mul,
        store_kv,
        *(x.value for x in limits),
        *widths,
        prefill,
        decode_layers,
    )


def is_available() -> bool:
    return load() is not None


def _applies(
    kernel: Kernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> bool:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and block_tables.dtype == context_lens.dtype == torch.int32
        and q.stride(2) == 1
        and q.stride(1) == head_dim  # the heads of a token side by side; tokens may be apart (a qkv view)
        and all(t.is_contiguous() for t in (k_cache, v_cache, block_tables, context_lens))
        and num_heads <= kernel.max_heads
        and num_heads // num_kv_heads <= kernel.max_group
        and head_dim % kernel.lanes == 0  # whole vectors: 16 floats with AVX-512, else 8
        and head_dim <= kernel.max_head_dim
        and block_size <= kernel.max_block_size
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """The signature of `torch_ops.paged_decode_attention`; None when the kernel is unavailable or the inputs
    are outside what it handles (the caller then takes the torch path)."""
    kernel = load()
    if kernel is None or not _applies(kernel, q, k_cache, v_cache, block_tables, context_lens):
        return None
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs:
        kernel.decode(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            block_tables.shape[1],
            scale,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor | None:
    """The signature of `torch_ops.paged_prefill_attention`; None when the kernel is unavailable or the inputs are
    outside what it handles (head dims that are not a multiple of the vector width included). Raises MemoryError
    when the kernel cannot allocate its scratch (the sequences' transposed keys) rather than return unwritten rows."""
    del max_seqlen_q  # the kernel splits each sequence into tasks itself
    kernel = load()
    if (
        kernel is None
        or not _applies(kernel, q, k_cache, v_cache, block_tables, context_lens)
        or q.shape[2] % kernel.lanes
        or cu_seqlens_q.dtype != torch.int32
        or not cu_seqlens_q.is_contiguous()
        or cu_seqlens_q.shape != (context_lens.shape[0] + 1,)
    ):
        return None
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    if num_tokens and kernel.prefill(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        context_lens.shape[0],
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
    ):
        raise MemoryError("prefill attention: out of memory for the sequences' transposed keys")
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """`torch_ops.apply_rotary` in place; False (nothing done) when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None:
        return False
    num_tokens, num_heads, head_dim = q.shape
    if not (
        q.device.type == "cpu"
        and q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[1] == head_dim
        and head_dim % 2 == 0
        and q.stride(2) == k.stride(2) == 1
        and q.stride(1) == k.stride(1) == head_dim
    ):
        return False
    if num_tokens:
        kernel.rotary(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            num_tokens,
            num_heads,
            k.shape[1],
            head_dim,
        )
    return True


def _rows_and_vector(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None) -> bool:
    """The inputs the row kernels (`linear`, `rms_norm`) take: float32 rows on CPU with unit column stride (rows
    may be apart), a contiguous float32 weight, and an optional contiguous float32 bias or residual."""
    return weight.dtype == torch.float32 and weight.is_contiguous() and _rows(x, extra)


def _rows(x: torch.Tensor, extra: torch.Tensor | None) -> bool:
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and (extra is None or (extra.dtype == torch.float32 and extra.is_contiguous()))
    )


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 [N, K] weight in the layout `linear` reads: panels of `panel_width` output features, [ceil(N /
    width), K, width], the last panel zero-padded (a copy; the weight's own bytes plus at most one panel). None
    when the kernel is unavailable or the weight is not a 2-D float32 CPU tensor."""
    kernel = load()
    if kernel is None or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    (num_out, num_in), width = weight.shape, kernel.panel_width
    panels = -(-num_out // width)
    padded = torch.zeros((panels * width, num_in), dtype=torch.float32)
    padded[:num_out] = weight
    return padded.view(panels, width, num_in).transpose(1, 2).contiguous()


def pack_block_weight(blocks: np.ndarray, weight_format: int, num_in: int) -> torch.Tensor | None:
    """A GGUF tensor's raw blocks, [N, num_in / 32 * block bytes] uint8 (Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit
    q, the first 16 weights in the low nibbles; Q8_0: fp16 d, 32 int8 q), in the layout `linear` reads with
    `weight_format`: per panel of `panel_width` outputs, per block of 32 along K, the scales as float32 for the
    whole panel, then the quants with each row of the block side by side (Q4_1: one byte per output holds
    weights 2i and 2i + 1, so the kernel walks K in order) — [panels, num_in / 32, 24 or 36 x width] uint8, the
    last panel's padding all zero. None when the kernel is unavailable or the shapes do not fit."""
    kernel = load()
    block_bytes = _BLOCK_BYTES.get(weight_format)
    if kernel is None or block_bytes is None or num_in % 32 or blocks.ndim != 2 or blocks.dtype != np.uint8:
        return None
    num_out, num_blocks, width = blocks.shape[0], num_in // 32, kernel.panel_width
    if blocks.shape[1] != num_blocks * block_bytes:
        return None
    panels = -(-num_out // width)
    padded = np.zeros((panels * width, num_blocks, block_bytes), dtype=np.uint8)
    padded[:num_out] = blocks.reshape(num_out, num_blocks, block_bytes)

    def by_panel(values: np.ndarray) -> np.ndarray:  # [N, blocks, *rest] -> [panels, blocks, *rest, width] bytes
        moved = values.reshape(panels, width, num_blocks, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(moved).reshape(panels, num_blocks, -1).view(np.uint8)

    def scales(offset: int) -> np.ndarray:  # fp16 at `offset` of each block -> float32 (exact)
        return by_panel(np.ascontiguousarray(padded[:, :, offset : offset + 2]).view(np.float16).astype(np.float32))

    if weight_format == WEIGHTS_Q4_1:
        packed_q = padded[:, :, 4:]
        q = np.concatenate([packed_q & 15, packed_q >> 4], axis=-1)  # [N, blocks, 32], along K
        parts = [scales(0), scales(2), by_panel(q[..., 0::2] | (q[..., 1::2] << 4))]
    else:
        parts = [scales(0), by_panel(padded[:, :, 2:])]
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape == (panels, num_blocks, _PANEL_BLOCK_BYTES[weight_format] * width)
    return torch.from_numpy(packed)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    num_out: int,
    bias: torch.Tensor | None,
    weight_format: int = WEIGHTS_F32,
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for x [M, K] (rows may be apart: a slice of a fused projection), float32 on
    CPU, with the weight [num_out, K] given packed (`pack_linear_weight`, or `pack_block_weight` with its
    `weight_format`); None when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None or not _rows(x, bias) or packed.dim() != 3:
        return None
    num_in, width = x.shape[1], kernel.panel_width
    if weight_format == WEIGHTS_F32:
        fits = packed.dtype == torch.float32 and packed.shape[1:] == (num_in, width)
    else:
        block = _PANEL_BLOCK_BYTES.get(weight_format)
        fits = block is not None and packed.dtype == torch.uint8 and packed.shape[1:] == (num_in // 32, block * width)
        fits = fits and num_in % 32 == 0
    if (
        not fits
        or not packed.is_contiguous()
        or not (packed.shape[0] - 1) * width < num_out <= packed.shape[0] * width
        or (bias is not None and bias.shape != (num_out,))
    ):
        return None
    num_rows = x.shape[0]
    out = torch.empty((num_rows, num_out), dtype=torch.float32)
    if num_rows and kernel.linear(
        x.data_ptr(),
        x.stride(0),
        num_rows,
        packed.data_ptr(),
        weight_format,
        num_out,
        num_in,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
    ):
        raise MemoryError("the native linear kernel could not allocate its dequantized panel")
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`torch_ops.rms_norm` in one pass per row (the residual add included); None when the kernel is unavailable or
    does not apply. With `residual`, the sum is written into `residual` and the result into `x` (the model passes
    a fresh projection output and its running sum, neither used again); without, into a new tensor."""
    kernel = load()
    if (
        kernel is None
        or not _rows_and_vector(x, weight, residual)
        or weight.shape != (x.shape[1],)
        or (residual is not None and residual.shape != x.shape)
    ):
        return None
    out = x if residual is not None else torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        kernel.rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            x.shape[1],
            eps,
        )
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`torch_ops.silu_and_mul` (in place in the gate half of `x`, which it returns); None when the kernel is
    unavailable or does not apply."""
    kernel = load()
    if kernel is None or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] % 2:
        return None
    inter = x.shape[1] // 2
    if x.numel():
        kernel.silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], inter)
    return x[:, :inter]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """`torch_ops.store_kv`; False (nothing done) when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None:
        return False
    num_tokens, num_kv_heads, head_dim = k.shape
    if not (
        k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k.device.type == "cpu"
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == head_dim
        and k_cache.shape[2:] == v_cache.shape[2:] == (num_kv_heads, head_dim)
    ):
        return False
    if num_tokens:
        kernel.store_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            num_tokens,
            num_kv_heads * head_dim,
        )
    return True
