"""KV write: scatter the new tokens' K and V into their paged-cache slots in one launch.

Cache layout (fixed): `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, so slot
`block_id * block_size + offset` starts at element `slot * num_kv_heads * head_dim`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import (
    check_kv_cache,
    check_last_dim_contiguous,
    check_same_device,
    kernel_for,
    pow2_at_least,
)

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # slot -1 marks a padding token (e.g. CUDA-graph padding): nothing to write.
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = slot * stride_cache_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `k[t]`, `v[t]` (`[T, num_kv_heads, head_dim]`) into cache slot `slot_mapping[t]`; slot -1 skips `t`.

    Values are cast to the cache dtype. Slots must be distinct (two tokens writing one slot race) and in range.
    """
    name = "store_kv"
    _, _, num_kv_heads, head_dim = check_kv_cache(name, k_cache, v_cache)
    device = check_same_device(name, k, v, k_cache, v_cache, slot_mapping)
    assert k.dim() == 3 and k.shape[1:] == (num_kv_heads, head_dim), (
        f"{name}: k must be [T, {num_kv_heads}, {head_dim}] to match the cache, got {tuple(k.shape)}"
    )
    assert v.shape == k.shape, f"{name}: v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}"
    check_last_dim_contiguous(name, "k", k)
    check_last_dim_contiguous(name, "v", v)
    assert slot_mapping.dtype == torch.int64, f"{name}: slot_mapping must be int64, got {slot_mapping.dtype}"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.is_contiguous(), (
        f"{name}: slot_mapping must be a contiguous [T={k.shape[0]}], got shape {tuple(slot_mapping.shape)}"
        f" strides {tuple(slot_mapping.stride())}"
    )
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    kernel_for(_store_kv_kernel, device)[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=pow2_at_least(num_kv_heads),
        BLOCK_D=pow2_at_least(head_dim),
    )
