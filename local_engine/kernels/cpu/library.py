"""Building, caching and loading the native CPU kernels (`kernels.c`), and their C signatures, declared once.

The kernels are compiled on first use with the machine's C compiler (`$CC`, else `cc`; `-O3 -march=native
-fopenmp`: AVX2 and FMA intrinsics) into `$XDG_CACHE_HOME/unigate/kernels` (default `~/.cache/...`), keyed by the
source, the compiler and the CPU, and loaded with ctypes (which releases the GIL during a call). Their OpenMP
runtime is torch's (same `libgomp.so.1`, already loaded), so they use torch's threads and add none. Where they
cannot be built (no compiler, not x86-64, no AVX2: the build fails and the reason is logged), `load` returns None
and the launchers hand every call back to the torch ops.

ctypes trusts the declared argument types: a declaration that drifted from its C prototype would corrupt memory
instead of raising. `SIGNATURES` is the only place they are declared, and a test parses the prototypes in
`kernels.c` and checks them against it (and `DecoderWeights` against `unigate_decoder_t`).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["FLAGS", "SIGNATURES", "SOURCE", "DecoderWeights", "Kernel", "is_available", "load"]

logger = logging.getLogger("unigate.engine")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
_P = ctypes.c_void_p  # any pointer to data: float *, const int32_t *, const uint8_t *, ...
_I = ctypes.c_int64
_F = ctypes.c_float
_INT = ctypes.c_int
_PP = ctypes.POINTER(ctypes.c_void_p)


class DecoderWeights(ctypes.Structure):
    """`unigate_decoder_t`: a model's shape and, per layer, pointers to its weights (projections as panels) and KV
    cache views (float32, or int8 with their scales). Null arrays: no q/k norm, no qkv or o bias, a float32 cache."""

    _fields_ = [
        *((name, _I) for name in ("num_layers", "hidden", "inter", "num_heads", "num_kv_heads", "head_dim")),
        ("block_size", _I),
        ("weight_format", _I),
        ("eps", _F),
        ("scale", _F),
        *((name, _PP) for name in ("input_norm", "post_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias")),
        *((name, _PP) for name in ("gate_up", "down", "k_cache", "v_cache", "k_scale", "v_scale")),
        ("final_norm", _P),
        ("cos_sin", _P),
    ]


# Every function `kernels.c` exports: name -> (restype, argtypes), in the order of the C parameters.
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "unigate_vector_lanes": (_I, ()),
    "unigate_cpu_kernels_limits": (_INT, (ctypes.POINTER(_I),) * 4),
    # q, q_stride, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
    # block_size, table_width, scale, k_scale, v_scale (null: a float32 cache)
    "unigate_paged_decode_f32": (None, (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P)),
    # q, q_stride, k_cache, v_cache, block_tables, table_width, cu_seqlens_q, context_lens, out, num_seqs, num_heads,
    # num_kv_heads, head_dim, block_size, scale, k_scale, v_scale (null: a float32 cache)
    "unigate_paged_prefill_f32": (_INT, (_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _P)),
    # q, q_stride, k, k_stride, positions, cos_sin, num_tokens, num_heads, num_kv_heads, head_dim
    "unigate_rotary_f32": (None, (_P, _I, _P, _I, _P, _P, _I, _I, _I, _I)),
    "unigate_linear_panel_width": (_I, ()),
    # x, ldx, m, packed, format, n_dim, k_dim, bias, y
    "unigate_linear_f32": (_INT, (_P, _I, _I, _P, _INT, _I, _I, _P, _P)),
    # packed, format, n_dim, k_dim, out
    "unigate_unpack_blocks_f32": (_INT, (_P, _INT, _I, _I, _P)),
    # x, x_stride, residual, weight, out, out_stride, num_rows, dim, eps
    "unigate_rms_norm_f32": (None, (_P, _I, _P, _P, _P, _I, _I, _I, _F)),
    # x, x_stride, num_rows, inter
    "unigate_silu_and_mul_f32": (None, (_P, _I, _I, _I)),
    # k, k_stride, v, v_stride, k_cache, v_cache, slots, num_tokens, row
    "unigate_store_kv_f32": (None, (_P, _I, _P, _I, _P, _P, _P, _I, _I)),
    # k, k_stride, v, v_stride, k_cache, v_cache, k_scale, v_scale, slots, num_tokens, num_kv_heads, head_dim,
    # block_size
    "unigate_store_kv_i8": (None, (_P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I)),
    # m, num_rows, res, out, positions, slots, block_tables, context_lens, table_width, scratch
    "unigate_decode_layers_f32": (_INT, (ctypes.POINTER(DecoderWeights), _I, _P, _P, _P, _P, _P, _P, _I, _P)),
}


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
    """The loaded library: its functions (typed from `SIGNATURES`) and the limits it was compiled with."""

    decode: Callable[..., Any]
    rotary: Callable[..., Any]
    linear: Callable[..., Any]
    unpack_blocks: Callable[..., Any]
    rms_norm: Callable[..., Any]
    silu_and_mul: Callable[..., Any]
    store_kv: Callable[..., Any]
    store_kv_int8: Callable[..., Any]
    prefill: Callable[..., Any]
    decode_layers: Callable[..., Any]
    max_heads: int
    max_group: int
    max_head_dim: int
    max_block_size: int
    panel_width: int  # output features per panel of a packed projection weight (`pack_linear_weight`)
    lanes: int  # floats per vector: 16 with AVX-512, else 8 (prefill attention takes head dims that are multiples)


def _declare(library: ctypes.CDLL) -> dict[str, Any]:
    """Each exported function with its restype and argtypes set from `SIGNATURES`."""
    functions = {}
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
        functions[name] = function
    return functions


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
    functions = _declare(library)
    limits = [ctypes.c_int64() for _ in range(4)]
    functions["unigate_cpu_kernels_limits"](*(ctypes.byref(x) for x in limits))
    max_heads, max_group, max_head_dim, max_block_size = (x.value for x in limits)
    return Kernel(
        decode=functions["unigate_paged_decode_f32"],
        rotary=functions["unigate_rotary_f32"],
        linear=functions["unigate_linear_f32"],
        unpack_blocks=functions["unigate_unpack_blocks_f32"],
        rms_norm=functions["unigate_rms_norm_f32"],
        silu_and_mul=functions["unigate_silu_and_mul_f32"],
        store_kv=functions["unigate_store_kv_f32"],
        store_kv_int8=functions["unigate_store_kv_i8"],
        prefill=functions["unigate_paged_prefill_f32"],
        decode_layers=functions["unigate_decode_layers_f32"],
        max_heads=max_heads,
        max_group=max_group,
        max_head_dim=max_head_dim,
        max_block_size=max_block_size,
        panel_width=functions["unigate_linear_panel_width"](),
        lanes=functions["unigate_vector_lanes"](),
    )


def is_available() -> bool:
    return load() is not None
