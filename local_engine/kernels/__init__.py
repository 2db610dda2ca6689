"""Triton kernels for the local engine, each with a plain torch reference in `reference.py`; the native CPU
kernels (C, built at start-up) in the subpackage `cpu/`. This module and `reference` implement `layers.backend.Ops`.

The launchers are imported lazily so that importing this package (e.g. to call `is_triton_available()`, or to
reach `kernels.cpu`) costs nothing and works where triton is not installed. CUDA tensors run the compiled kernels;
CPU tensors run the same kernels in Triton's interpreter (slow: tests and smoke runs only).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers only: at run time `__getattr__` imports each launcher on first use
    from local_engine.kernels.activation import silu_and_mul
    from local_engine.kernels.decode_attention import paged_decode_attention
    from local_engine.kernels.kv_write import store_kv
    from local_engine.kernels.norm import rms_norm
    from local_engine.kernels.prefill_attention import paged_prefill_attention
    from local_engine.kernels.rotary import apply_rotary

__all__ = [
    "apply_rotary",
    "is_triton_available",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]

_LAUNCHER_MODULES = {
    "apply_rotary": "rotary",
    "paged_decode_attention": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "rms_norm": "norm",
    "silu_and_mul": "activation",
    "store_kv": "kv_write",
}


def is_triton_available() -> bool:
    """True when the kernels can serve the engine: triton is installed and a CUDA device is present, or
    `TRITON_INTERPRET=1` asks for the interpreter explicitly (CPU tensors always run interpreted when launched).
    """
    if importlib.util.find_spec("triton") is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        return True
    import torch

    return bool(torch.cuda.is_available())


def __getattr__(name: str) -> Any:
    module = _LAUNCHER_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    launcher = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = launcher
    return launcher
