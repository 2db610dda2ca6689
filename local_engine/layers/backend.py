"""Choose the implementation of the six engine operations by name: "torch" (this package, optionally with the
native CPU kernels) or "triton"."""

from __future__ import annotations

from types import ModuleType

__all__ = ["select_ops"]


def select_ops(attention_backend: str, *, native_cpu: bool = False) -> ModuleType:
    """The module providing store_kv, paged_decode_attention, paged_prefill_attention, rms_norm, apply_rotary
    and silu_and_mul with identical signatures (apply_rotary works in place; silu_and_mul may overwrite its
    input, which the model never reads again). `native_cpu`: the torch ops with decode attention and
    rotary through the C kernels of `layers/cpu_kernels.py`, when they build on this machine."""
    if attention_backend == "torch":
        from local_engine.layers import cpu_kernels, torch_ops

        if native_cpu and cpu_kernels.is_available():
            from local_engine.layers import cpu_ops

            return cpu_ops
        return torch_ops
    if attention_backend == "triton":
        import local_engine.kernels as kernels

        if not kernels.is_triton_available():
            raise RuntimeError("attention_backend 'triton' needs triton and a CUDA device; use 'torch' instead")
        return kernels
    raise ValueError(f"unknown attention_backend {attention_backend!r} (use 'torch' or 'triton')")
