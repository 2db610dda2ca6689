"""Paged decode attention: one new query token per sequence against the KV of its whole context.

One program serves every query head of one KV head (grouped-query attention), so each K/V tile is read once for
the whole group. Long contexts are split across programs ("flash decoding"): each split writes its partial output
and log-sum-exp, and a second kernel merges them. The split count is chosen on the host from the block table's
width (an upper bound on the context length) and the batch size, never from `context_lens`, so there is no
host-device synchronisation and a CUDA graph captured for one shape replays correctly. The split count is a
runtime argument, so a new count does not compile a new kernel.

Numerics: scores and softmax in float32 with a running max and sum, in base 2 (`exp2`, scale pre-multiplied by
log2(e)). A sequence with `context_len == 0` produces zeros, never NaN.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import (
    check_kv_scales,
    check_last_dim_contiguous,
    check_paged_attention,
    kernel_for,
    pow2_at_least,
)

__all__ = ["choose_num_splits", "paged_decode_attention"]

_BLOCK_N = 64  # keys per tile; tiles may span several cache blocks (each token's block is looked up)
_MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep memory requests in flight


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_INT8: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    context_len = tl.load(context_lens_ptr + seq)
    if IS_SPLIT:
        # Splits are sized per sequence (whole tiles), so every split of a long sequence has work.
        split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, context_len)
    else:
        start = 0
        end = context_len

    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # Every tile holds at least one key < end, so the running max is finite after the first tile.
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < end
        block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=mask_n, other=0)
        kv_offs = (
            block_id.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IS_INT8:  # each key times its block's scale for this KV head
            scale_offs = block_id.to(tl.int64) * stride_scale_block + kv_head
            k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_offs, mask=mask_n, other=0.0)[:, None]
        k = k.to(q.dtype)  # a cache in another float dtype is read as q's
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_H, BLOCK_N], float32
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IS_INT8:
            v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_offs, mask=mask_n, other=0.0)[:, None]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty context (or an empty split) leaves l_i == 0: emit zeros and lse = -inf instead of 0/0.
    is_nonempty = l_i > 0.0
    l_safe = tl.where(is_nonempty, l_i, 1.0)
    out = acc / l_safe[:, None]
    out_mask = mask_h[:, None] & mask_d[None, :]
    out_offs = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    if IS_SPLIT:
        lse = tl.where(is_nonempty, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All splits empty (context_len == 0): shift by 0 so the weights are exp2(-inf) = 0, not exp2(NaN).
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, 0)
    partial = tl.load(
        partial_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many splits to cut each context into: enough programs to fill the GPU, no split under ~256 tokens."""
    if max_context_len < 2 * _MIN_TOKENS_PER_SPLIT:
        return 1
    num_programs = max(num_seqs * num_kv_heads, 1)
    wanted = math.ceil(_PROGRAMS_PER_SM * num_sms / num_programs)
    return max(1, min(wanted, max_context_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of `q` `[B, H, D]` (one token per sequence) over each sequence's cached context.

    `block_tables[b, i]` is the cache block holding tokens `i*block_size ...` of sequence `b`; entries past the
    context are never read. `context_lens[b]` counts the tokens to attend to (the new token's KV included, already
    written by `store_kv`). Returns `[B, H, D]` in q's dtype. The cache may hold another float dtype (read as q's)
    or int8 with `k_scale` / `v_scale` [num_blocks, num_kv_heads] (each K/V tile dequantized as it is loaded).

    `max_context_len` (a host-side upper bound on `context_lens`, default `block_tables.shape[1] * block_size`) and
    `num_splits` (default chosen from it) only tune speed. Tolerance vs the float32 reference: ~1e-5 in float32 in
    the interpreter; on GPU ~1e-2 absolute in bfloat16 (p is rounded to bf16 before the PV product) and ~1e-3 in
    float32 (the tensor cores use tf32).
    """
    name = "paged_decode_attention"
    num_seqs = q.shape[0]
    num_heads, num_kv_heads, block_size = check_paged_attention(name, q, k_cache, v_cache, block_tables, num_seqs)
    is_int8 = check_kv_scales(name, k_cache, k_scale, v_scale)
    assert context_lens.dtype == torch.int32 and context_lens.shape == (num_seqs,), (
        f"{name}: context_lens must be int32 [num_seqs={num_seqs}], got {context_lens.dtype} "
        f"{tuple(context_lens.shape)}"
    )
    check_last_dim_contiguous(name, "context_lens", context_lens)
    head_dim = q.shape[2]
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out

    if num_splits is None:
        upper_bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
        num_sms = _num_sms(q.device.index or 0) if q.device.type == "cuda" else 4
        num_splits = choose_num_splits(num_seqs, num_kv_heads, upper_bound, num_sms)
    assert num_splits >= 1, f"{name}: num_splits must be >= 1, got {num_splits}"

    group = num_heads // num_kv_heads
    block_d = pow2_at_least(head_dim, 16)
    if num_splits == 1:
        partial, lse = out, out  # lse is not written on this path; any pointer will do
        partial_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        partial = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        partial_strides = (partial.stride(0), partial.stride(1), partial.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))

    kernel_for(_decode_attention_kernel, q.device)[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # any pointer when the cache is not int8: never read then
        v_cache if v_scale is None else v_scale,
        block_tables,
        context_lens,
        partial,
        lse,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        block_tables.stride(0),
        *partial_strides,
        *lse_strides,
        num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        IS_INT8=is_int8,
        IS_SPLIT=num_splits > 1,
        # tl.dot needs at least 16 rows; the padding rows load zeros and are never stored.
        BLOCK_H=pow2_at_least(group, 16),
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
    )
    if num_splits > 1:
        kernel_for(_merge_splits_kernel, q.device)[(num_seqs, num_heads)](
            partial,
            lse,
            out,
            *partial_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=pow2_at_least(num_splits),
            BLOCK_D=block_d,
        )
    return out
