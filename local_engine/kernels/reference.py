"""Plain torch references for every kernel: the same signatures and semantics, written to be obviously correct.

Slow on purpose (per-sequence Python loops, float32 everywhere); the kernels are tested against these.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_rotary",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim]
    """The first `context_len` tokens of one sequence, read block by block through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = [cache[int(block_id)] for block_id in block_table[:num_blocks]]
    if not blocks:
        return cache.new_zeros((0, *cache.shape[2:]))
    return torch.cat(blocks)[:context_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_cached: int) -> torch.Tensor:
    """Causal attention of `q` `[n, H, D]` (positions `num_cached ...`) over `k`, `v` `[ctx, KVH, D]`; float32."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, H, D]
    v = v.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, n, ctx]
    q_pos = torch.arange(q.shape[0], device=q.device) + num_cached
    k_pos = torch.arange(k.shape[0], device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]  # [n, ctx]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [n, H, D]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[seq], context_len)
        v = gather_kv(v_cache, block_tables[seq], context_len)
        out[seq] = _attend(q[seq : seq + 1], k, v, scale, num_cached=context_len - 1)[0].to(q.dtype)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if start == end:
            continue
        assert end - start <= max_seqlen_q
        k = gather_kv(k_cache, block_tables[seq], context_len)
        v = gather_kv(v_cache, block_tables[seq], context_len)
        out[start:end] = _attend(q[start:end], k, v, scale, num_cached=context_len - (end - start)).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), (x if residual is not None else None)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions].float()  # [T, rotary_dim]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half] = rotated.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
