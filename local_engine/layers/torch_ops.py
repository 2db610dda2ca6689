"""The six engine operations in plain torch: the "torch" attention backend, run on CPU and as the GPU fallback.

Signatures match `local_engine.kernels` exactly, so the model calls either through one `ops` object. KV cache
layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "apply_rotary",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, KVH, D] into their slots; slot -1 means skip."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, KVH, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, KVH, D] tokens in order.
    (`index_select` on the flattened ids is ~3x faster on CPU than advanced indexing for the same copy.)"""
    gathered = cache.index_select(0, block_ids.reshape(-1))  # [n, bs, KVH, D]
    return gathered.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


# Decode sequences are attended in groups of similar context length, so padding every sequence to the longest
# one does not multiply the gather and attention work (the scheduler orders decodes longest first).
MAX_DECODE_GROUP = 8
MIN_GROUP_FILL = 0.75


def _decode_groups(lens: list[int]) -> list[tuple[int, int]]:
    groups = []
    start = 0
    while start < len(lens):
        end = start + 1
        longest = max(lens[start], 1)
        while end < len(lens) and end - start < MAX_DECODE_GROUP and MIN_GROUP_FILL * longest <= lens[end] <= longest:
            end += 1
        groups.append((start, end))
        start = end
    return groups


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its whole context. q [B, H, D] -> [B, H, D]."""
    lens = context_lens.tolist()
    if not lens or max(lens) == 0:
        return torch.zeros_like(q)
    groups = _decode_groups(lens)
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, block_tables, context_lens, lens, scale)
    out = torch.empty_like(q)
    for start, end in groups:
        out[start:end] = _decode_group(
            q[start:end], k_cache, v_cache, block_tables[start:end], context_lens[start:end], lens[start:end], scale
        )
    return out


def _decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: the G = H / KVH query heads of one KV head ride along the
    "query length" axis of SDPA, so q becomes [B, KVH, G, D] against k [B, KVH, L, D]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    k = _gather(k_cache, table)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
    v = _gather(v_cache, table)[:, :max_len].transpose(1, 2)
    group = num_heads // num_kv_heads
    q = q.view(num_seqs, num_kv_heads, group, head_dim)  # head h uses KV head h // G, as in HF
    mask = None if min(lens) == max_len else _length_mask(context_lens, max_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def _length_mask(context_lens: torch.Tensor, padded_len: int) -> torch.Tensor:
    positions = torch.arange(padded_len, device=context_lens.device)
    return (positions[None, :] < context_lens[:, None]).view(len(context_lens), 1, 1, -1)  # [B, 1, 1, L]


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
    """Packed variable-length prefill. The q_len new tokens of sequence s are the last q_len of its
    context_len tokens (their KV already stored); query i attends keys [0, context_len - q_len + i].
    q [T, H, D] -> [T, H, D]. One SDPA call per sequence with a bottom-right-aligned causal bias, which lets
    the CPU flash kernel skip the masked half instead of materialising a mask."""
    del max_seqlen_q  # the kernels size their grid with it; the per-sequence loop here does not need it
    num_heads = q.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for s, context_len in enumerate(context_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        table = block_tables[s, : -(-context_len // block_size)].long()
        k = _gather(k_cache, table)[:context_len].transpose(0, 1)  # [KVH, ctx, D]
        v = _gather(v_cache, table)[:context_len].transpose(0, 1)
        q_s = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(
            q_s,
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=causal_lower_right(q_len, context_len),
            scale=scale,
            enable_gqa=group > 1,  # head h reads KV head h // G, as in HF, without repeating K and V
        )  # [1, H, q_len, D]
        out[start:end] = o[0].transpose(0, 1)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With `residual`: x += residual first and return the sum as the new residual. Math in float32, as HF."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:  # one fused op, the same math (and the same results) as below
        return F.rms_norm(x, weight.shape, weight, eps), residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In place, HF rotate_half style: x * cos + rotate_half(x) * sin. q [T, H, D], k [T, KVH, D]."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        first = torch.addcmul(x1 * cos, x2, sin, value=-1.0)  # x1 cos - x2 sin
        x2.copy_(torch.addcmul(x2 * cos, x1, sin))  # x2 cos + x1 sin (reads x1 before it is overwritten)
        x1.copy_(first)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:]: the gate and up projections computed as one matmul. Works in place in the gate
    half of `x` (the model passes a fresh projection output) and returns that strided view: at prefill sizes two
    fresh [T, I] tensors cost more than the arithmetic."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)
