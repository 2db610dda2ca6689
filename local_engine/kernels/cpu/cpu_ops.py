"""The torch ops, with all six (prefill and decode attention, rotary, RMSNorm, silu-and-mul and the KV cache write)
through the native CPU kernels (`launch`) wherever they apply: an implementation of `layers.backend.Ops`.

Chosen by `select_ops` for the torch backend on CPU when `cpu_kernels` is on (the default) and the kernels
build; any call they do not handle (another dtype, shapes past their limits) takes the torch path.
"""

from __future__ import annotations

import torch

from local_engine.kernels.cpu import launch
from local_engine.layers import torch_ops

__all__ = [
    "apply_rotary",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`torch_ops.paged_decode_attention`, reading the cache blocks in place when the kernel applies."""
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    out = launch.paged_decode_attention(*args)
    return torch_ops.paged_decode_attention(*args) if out is None else out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`torch_ops.paged_prefill_attention`, reading the cache blocks in place when the kernel applies."""
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale, k_scale, v_scale)
    out = launch.paged_prefill_attention(*args)
    return torch_ops.paged_prefill_attention(*args) if out is None else out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """`torch_ops.apply_rotary` (in place), in one native pass when the kernel applies."""
    if not launch.apply_rotary(q, k, positions, cos_sin_cache):
        torch_ops.apply_rotary(q, k, positions, cos_sin_cache)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`torch_ops.store_kv`, one copy (or quantization) per token row when the kernel applies."""
    if not launch.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
        torch_ops.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`torch_ops.rms_norm`, in one pass per row when the kernel applies. With `residual`, `x` and `residual`
    are overwritten (the model passes a fresh projection output and its running sum, neither used again)."""
    out = launch.rms_norm(x, weight, eps, residual)
    return torch_ops.rms_norm(x, weight, eps, residual) if out is None else out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`torch_ops.silu_and_mul` (in place in the gate half of `x`), in one pass when the kernel applies."""
    out = launch.silu_and_mul(x)
    return torch_ops.silu_and_mul(x) if out is None else out
