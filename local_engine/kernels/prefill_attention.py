"""Paged prefill/extend attention: a packed batch of new-token chunks against their sequences' paged KV.

Sequence `s` contributes `q_len_s = cu_seqlens_q[s+1] - cu_seqlens_q[s]` query rows, the LAST `q_len_s` of its
`context_len_s` tokens. Their KV is already in the cache (written by `store_kv` before the call), together with
any prefix-cached or earlier-chunk tokens before them. Query row `i` sits at position `context_len_s - q_len_s + i`
and attends causally to keys `[0, context_len_s - q_len_s + i]`.

One program handles `BLOCK_M` query rows of one sequence and one query head, walking the keys in tiles of
`BLOCK_N` with an online softmax (float32, base 2). Tiles past the last row's position are never visited.
"""

from __future__ import annotations

import math

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

__all__ = ["paged_prefill_attention"]

_BLOCK_M = 64
_BLOCK_N = 64


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_scale_block,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_INT8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # The grid covers the longest sequence; shorter ones have nothing to do in their trailing row blocks.
    if m_block * BLOCK_M >= q_len:
        return
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    num_cached = context_len - q_len  # tokens before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_pos = num_cached + offs_m  # absolute position of each query row

    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys up to the last row of this block. Every row (padding rows too) sees key 0, so each row's running max
    # is finite after the first tile and fully masked later tiles add exp2(-inf) = 0.
    end = tl.minimum(context_len, num_cached + tl.minimum((m_block + 1) * BLOCK_M, q_len))
    for tile_start in range(0, end, BLOCK_N):
        k_pos = tile_start + offs_n
        mask_n = k_pos < end
        block_id = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=mask_n, other=0)
        kv_offs = (
            block_id.to(tl.int64) * stride_cache_block
            + (k_pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IS_INT8:  # each key times its block's scale for this KV head
            scale_offs = block_id.to(tl.int64) * stride_scale_block + kv_head
            k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_offs, mask=mask_n, other=0.0)[:, None]
        k = k.to(q.dtype)  # a cache in another float dtype is read as q's
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], float32
        is_visible = (k_pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        scores = tl.where(is_visible, scores, float("-inf"))
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

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


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
    """Causal attention of the packed new tokens `q` `[T, H, D]` over their sequences' paged KV.

    `cu_seqlens_q` (int32 `[S+1]`, `cu[0] == 0`, `cu[S] == T`) delimits each sequence's rows; `context_lens`
    (int32 `[S]`) counts each sequence's tokens including the new ones, so `q_len_s <= context_len_s` must hold.
    `max_seqlen_q` is a host-side upper bound on `q_len_s` (it sizes the grid; no device read). Returns `[T, H, D]`
    in q's dtype; the cache as in `paged_decode_attention`. Tolerance vs the float32 reference: ~1e-5 in float32
    in the interpreter; on GPU ~1e-2 absolute in bfloat16 and ~1e-3 in float32 (tf32 tensor cores).
    """
    name = "paged_prefill_attention"
    assert context_lens.dtype == torch.int32 and context_lens.dim() == 1, (
        f"{name}: context_lens must be int32 [num_seqs], got {context_lens.dtype} {tuple(context_lens.shape)}"
    )
    num_seqs = context_lens.shape[0]
    num_heads, num_kv_heads, block_size = check_paged_attention(name, q, k_cache, v_cache, block_tables, num_seqs)
    is_int8 = check_kv_scales(name, k_cache, k_scale, v_scale)
    check_last_dim_contiguous(name, "context_lens", context_lens)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (num_seqs + 1,), (
        f"{name}: cu_seqlens_q must be int32 [num_seqs+1={num_seqs + 1}], got {cu_seqlens_q.dtype} "
        f"{tuple(cu_seqlens_q.shape)}"
    )
    check_last_dim_contiguous(name, "cu_seqlens_q", cu_seqlens_q)
    assert max_seqlen_q >= 0, f"{name}: max_seqlen_q must be >= 0, got {max_seqlen_q}"
    num_tokens, _, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out

    grid = (triton.cdiv(max_seqlen_q, _BLOCK_M), num_seqs, num_heads)
    kernel_for(_prefill_attention_kernel, q.device)[grid](
        q,
        k_cache,
        v_cache,
        k_cache if k_scale is None else k_scale,  # any pointer when the cache is not int8: never read then
        v_cache if v_scale is None else v_scale,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        IS_INT8=is_int8,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=pow2_at_least(head_dim, 16),
    )
    return out
