"""The torch ops, with decode attention and rotary through the native CPU kernels (`cpu_kernels`) wherever
they apply.

Chosen by `select_ops` for the torch backend on CPU when `cpu_kernels` is on (the default) and the kernels
build; any call they do not handle (another dtype, shapes past their limits) takes the torch path.
"""

from __future__ import annotations

import torch

from local_engine.layers import cpu_kernels, torch_ops
from local_engine.layers.torch_ops import paged_prefill_attention, rms_norm, silu_and_mul, store_kv

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
) -> torch.Tensor:
    """`torch_ops.paged_decode_attention`, reading the cache blocks in place when the kernel applies."""
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if out is None:
        return torch_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """`torch_ops.apply_rotary` (in place), in one native pass when the kernel applies."""
    if not cpu_kernels.apply_rotary(q, k, positions, cos_sin_cache):
        torch_ops.apply_rotary(q, k, positions, cos_sin_cache)
