"""Rotary position embedding applied to q and k in place (neox / Hugging Face `rotate_half` style).

`cos_sin_cache[p] = cat(cos(p * inv_freq), sin(p * inv_freq))` has `rotary_dim` columns (usually head_dim). The
engine builds it, rope scaling (e.g. Llama 3) included, so the kernel knows nothing about scaling. Dimensions past
`rotary_dim` (partial rotary) are left as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import check_last_dim_contiguous, check_same_device, kernel_for, pow2_at_least

__all__ = ["apply_rotary"]


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    offs = tl.arange(0, BLOCK_HALF)
    mask_d = offs < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cs + offs, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + offs, mask=mask_d, other=0.0).to(tl.float32)

    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq[:, None] < NUM_HEADS) & mask_d[None, :]
    first = q_ptr + token * stride_qt + offs_hq[:, None] * stride_qh + offs[None, :]
    x1 = tl.load(first, mask=mask_q, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask_q, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask_q)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask_q)

    offs_hk = tl.arange(0, BLOCK_HK)
    mask_k = (offs_hk[:, None] < NUM_KV_HEADS) & mask_d[None, :]
    first = k_ptr + token * stride_kt + offs_hk[:, None] * stride_kh + offs[None, :]
    x1 = tl.load(first, mask=mask_k, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask_k, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask_k)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask_k)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotate `q` `[T, H, D]` and `k` `[T, KVH, D]` in place by the angles of `positions` (int64 `[T]`).

    q and k may be strided views (e.g. slices of a fused qkv projection) as long as the last dim is contiguous.
    Math in float32. Tolerance vs the reference: ~1e-6 in float32; one bf16 ulp in bfloat16 on GPU.
    """
    name = "apply_rotary"
    device = check_same_device(name, q, k, positions, cos_sin_cache)
    assert q.dim() == 3 and k.dim() == 3, f"{name}: q and k must be 3-D, got {tuple(q.shape)} and {tuple(k.shape)}"
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, (
        f"{name}: k must be [{num_tokens}, num_kv_heads, {head_dim}], got {tuple(k.shape)}"
    )
    assert positions.dtype == torch.int64 and positions.shape == (num_tokens,), (
        f"{name}: positions must be int64 [T={num_tokens}], got {positions.dtype} {tuple(positions.shape)}"
    )
    assert positions.is_contiguous(), f"{name}: positions must be contiguous"
    assert cos_sin_cache.dim() == 2, f"{name}: cos_sin_cache must be [max_position, rotary_dim]"
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (
        f"{name}: cos_sin_cache has {rotary_dim} columns; need an even number <= head_dim ({head_dim})"
    )
    assert cos_sin_cache.is_floating_point(), f"{name}: cos_sin_cache must be floating point"
    for arg, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        check_last_dim_contiguous(name, arg, t)
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    half = rotary_dim // 2
    kernel_for(_rotary_kernel, device)[(num_tokens,)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HQ=pow2_at_least(num_heads),
        BLOCK_HK=pow2_at_least(num_kv_heads),
        BLOCK_HALF=pow2_at_least(half),
    )
