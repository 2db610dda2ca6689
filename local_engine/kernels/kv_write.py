"""KV write: scatter the new tokens' K and V into their paged-cache slots in one launch.

Cache layout (fixed): `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, so slot
`block_id * block_size + offset` starts at element `slot * num_kv_heads * head_dim`.

An int8 cache follows the rule of `reference.py` (per-(block, KV head) scales that only grow, earlier entries
requantized when they do): one program per token, of which the first token of each run (consecutive tokens in one
block) does the run's work and the others return. No host synchronisation, so a CUDA graph can capture it. Runs of
one block must not repeat within a call (two programs would race on its scale); the engine never writes one block
from two places in a step. Rounding is half to even from `floor`, as the interpreter has no `rint`; on a GPU the
compiler may fuse `x * (1 / scale) + 0.5`, so an element can land one step away from the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import (
    check_kv_cache,
    check_kv_scales,
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


@triton.jit
def _store_kv_int8_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    previous = tl.load(slot_mapping_ptr + token - 1, mask=token > 0, other=-1).to(tl.int64)
    if (previous >= 0) & (previous // BLOCK_SIZE == block):
        return  # not the first token of its run: that token's program writes it
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < NUM_KV_HEADS
    mask = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)
    k_offs = offs_h[:, None] * stride_kh + offs_d[None, :]
    v_offs = offs_h[:, None] * stride_vh + offs_d[None, :]
    cache_offs = offs_h[:, None] * stride_cache_head + offs_d[None, :]
    # A scalar condition joins a tile's mask as a tile of its own (the interpreter rejects the broadcast form).
    zeros = (offs_h[:, None] + offs_d[None, :]) * 0

    # The run: at most BLOCK_SIZE tokens from this one on (its slots are distinct), up to the first slot -1 or slot
    # of another block. Its largest |k| and |v| per head, and its lowest offset in the block.
    k_amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    v_amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = block * 0 + BLOCK_SIZE
    is_alive = block >= 0
    for i in range(0, BLOCK_SIZE):
        t = token + i
        s = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
        is_alive = is_alive & (s >= 0) & (s // BLOCK_SIZE == block)
        live = mask & ((zeros + is_alive.to(tl.int32)) != 0)
        k = tl.load(k_ptr + t * stride_kt + k_offs, mask=live, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + v_offs, mask=live, other=0.0).to(tl.float32)
        k_amax = tl.maximum(k_amax, tl.max(tl.abs(k), 1))
        v_amax = tl.maximum(v_amax, tl.max(tl.abs(v), 1))
        first = tl.where(is_alive, tl.minimum(first, s % BLOCK_SIZE), first)

    scale_offs = block * NUM_KV_HEADS + offs_h
    k_base = tl.where(first == 0, 0.0, tl.load(k_scale_ptr + scale_offs, mask=mask_h, other=0.0))
    v_base = tl.where(first == 0, 0.0, tl.load(v_scale_ptr + scale_offs, mask=mask_h, other=0.0))
    k_new = tl.maximum(k_base, k_amax / 127.0)
    v_new = tl.maximum(v_base, v_amax / 127.0)
    k_inv = tl.where(k_new > 0.0, 1.0 / k_new, 0.0)
    v_inv = tl.where(v_new > 0.0, 1.0 / v_new, 0.0)
    k_ratio = (k_base * k_inv)[:, None]
    v_ratio = (v_base * v_inv)[:, None]
    k_grown = mask & ((k_base > 0.0) & (k_new > k_base))[:, None]
    v_grown = mask & ((v_base > 0.0) & (v_new > v_base))[:, None]

    # Requantize the entries below the run's first offset, in the heads whose scale grew. Rounding, here and below:
    # half to even, from floor (y + 0.5) moved down by one at a tie that landed on an odd number.
    block_start = block * BLOCK_SIZE * stride_cache_slot
    for o in range(0, BLOCK_SIZE):
        row = block_start + o * stride_cache_slot + cache_offs
        is_below = (zeros + (o < first).to(tl.int32)) != 0
        k_mask = k_grown & is_below
        v_mask = v_grown & is_below
        y = tl.load(k_cache_ptr + row, mask=k_mask, other=0).to(tl.float32) * k_ratio
        r = tl.floor(y + 0.5)
        r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
        tl.store(k_cache_ptr + row, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=k_mask)
        y = tl.load(v_cache_ptr + row, mask=v_mask, other=0).to(tl.float32) * v_ratio
        r = tl.floor(y + 0.5)
        r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
        tl.store(v_cache_ptr + row, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=v_mask)

    # The run's tokens, with the new scales.
    is_alive = block >= 0
    for i in range(0, BLOCK_SIZE):
        t = token + i
        s = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
        is_alive = is_alive & (s >= 0) & (s // BLOCK_SIZE == block)
        row = s * stride_cache_slot + cache_offs
        live = mask & ((zeros + is_alive.to(tl.int32)) != 0)
        y = tl.load(k_ptr + t * stride_kt + k_offs, mask=live, other=0.0).to(tl.float32) * k_inv[:, None]
        r = tl.floor(y + 0.5)
        r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
        tl.store(k_cache_ptr + row, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=live)
        y = tl.load(v_ptr + t * stride_vt + v_offs, mask=live, other=0.0).to(tl.float32) * v_inv[:, None]
        r = tl.floor(y + 0.5)
        r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
        tl.store(v_cache_ptr + row, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=live)
    tl.store(k_scale_ptr + scale_offs, k_new, mask=mask_h)
    tl.store(v_scale_ptr + scale_offs, v_new, mask=mask_h)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write `k[t]`, `v[t]` (`[T, num_kv_heads, head_dim]`) into cache slot `slot_mapping[t]`; slot -1 skips `t`.

    Values are cast to the cache dtype; an int8 cache (`k_scale`, `v_scale` [num_blocks, num_kv_heads] float32) is
    quantized by the rule of `reference.py`. Slots must be distinct (two tokens writing one slot race) and in range.
    """
    name = "store_kv"
    _, block_size, num_kv_heads, head_dim = check_kv_cache(name, k_cache, v_cache)
    is_int8 = check_kv_scales(name, k_cache, k_scale, v_scale)
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
    if is_int8:
        kernel_for(_store_kv_int8_kernel, device)[(num_tokens,)](
            k,
            v,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            slot_mapping,
            num_tokens,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(1),
            k_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_H=pow2_at_least(num_kv_heads),
            BLOCK_D=pow2_at_least(head_dim),
        )
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
