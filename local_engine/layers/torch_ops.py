"""The six engine operations in plain torch: the "torch" attention backend, run on CPU and as the GPU fallback.

Signatures match `local_engine.kernels` exactly, so the model calls either through one `ops` object. KV cache
layout per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is `block_id * block_size + offset`.
A bfloat16/float16 cache is read as the query's dtype; an int8 one (with `k_scale` / `v_scale` [num_blocks, KVH])
is written by the rule of `kernels/reference.py` and dequantized block by block as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from local_engine.kernels import reference

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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [T, KVH, D] into their slots; slot -1 means skip."""
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs its scales"
        _store_kv_int8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, KVH, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _store_kv_int8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """The int8 rule of `kernels/reference.py`, vectorised over blocks when each block's tokens form one run (the
    engine's batches always do); else token run by token run, as the reference."""
    block_size = k_cache.shape[1]
    blocks_all = torch.where(slot_mapping >= 0, slot_mapping // block_size, -1)
    starts = blocks_all != torch.cat((blocks_all.new_full((1,), -1), blocks_all[:-1]))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = blocks_all[keep]
    unique, index = torch.unique(blocks, return_inverse=True)
    if int((starts & keep).sum()) != unique.numel():
        for run in reference.kv_runs(slot_mapping.tolist(), block_size):
            run_slots = [int(s) for s in slot_mapping[run]]
            reference.store_run_int8(k[run], k_cache, k_scale, run_slots)
            reference.store_run_int8(v[run], v_cache, v_scale, run_slots)
        return
    offsets = slots % block_size
    fresh = torch.zeros(unique.numel(), dtype=torch.bool, device=slots.device)
    fresh[index[offsets == 0]] = True
    first = torch.full((unique.numel(),), block_size, dtype=offsets.dtype, device=slots.device)
    first.scatter_reduce_(0, index, offsets, "amin")
    for x, cache, scales in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        amax = torch.zeros((unique.numel(), cache.shape[2]), dtype=torch.float32, device=x.device)
        per_token = x.float().abs().amax(-1)  # [T, KVH]
        amax.scatter_reduce_(0, index[:, None].expand_as(per_token), per_token, "amax")  # [U, KVH]
        base = torch.where(fresh[:, None], torch.zeros_like(amax), scales[unique])
        new = torch.maximum(base, amax / 127.0)
        inv = torch.where(new > 0, 1.0 / new, torch.zeros_like(new))
        grew = (base > 0) & (new > base) & (first > 0)[:, None]
        if bool(grew.any()):  # requantize the older entries of the blocks whose scale grew
            rows = grew.any(1)
            ids, old = unique[rows], cache[unique[rows]]  # [R, bs, KVH, D]
            requantized = reference.quantize(old.float() * (base * inv)[rows][:, None, :, None])
            below = torch.arange(block_size, device=x.device)[None, :] < first[rows][:, None]  # [R, bs]
            select = below[:, :, None] & grew[rows][:, None, :]  # [R, bs, KVH]
            cache[ids] = torch.where(select[..., None], requantized, old)
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        flat[slots] = reference.quantize(x.float() * inv[index][:, :, None])
        scales[unique] = new


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., num_blocks * block_size, KVH, D] tokens in order, as `dtype` (an int8
    cache times its per-(block, head) `scales`). (`index_select` on the flattened ids is ~3x faster on CPU than
    advanced indexing for the same copy.)"""
    ids = block_ids.reshape(-1)
    gathered = cache.index_select(0, ids)  # [n, bs, KVH, D]
    if scales is not None:
        gathered = gathered.to(torch.float32) * scales.index_select(0, ids)[:, None, :, None]
    if gathered.dtype != dtype:
        gathered = gathered.to(dtype)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its whole context. q [B, H, D] -> [B, H, D]."""
    lens = context_lens.tolist()
    if not lens or max(lens) == 0:
        return torch.zeros_like(q)
    groups = _decode_groups(lens)
    scales = (k_scale, v_scale)
    if len(groups) == 1:
        return _decode_group(q, k_cache, v_cache, block_tables, context_lens, lens, scale, scales)
    out = torch.empty_like(q)
    for start, end in groups:
        out[start:end] = _decode_group(
            q[start:end],
            k_cache,
            v_cache,
            block_tables[start:end],
            context_lens[start:end],
            lens[start:end],
            scale,
            scales,
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
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: the G = H / KVH query heads of one KV head ride along the
    "query length" axis of SDPA, so q becomes [B, KVH, G, D] against k [B, KVH, L, D]."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    k = _gather(k_cache, table, scales[0], q.dtype)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
    v = _gather(v_cache, table, scales[1], q.dtype)[:, :max_len].transpose(1, 2)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
        k = _gather(k_cache, table, k_scale, q.dtype)[:context_len].transpose(0, 1)  # [KVH, ctx, D]
        v = _gather(v_cache, table, v_scale, q.dtype)[:context_len].transpose(0, 1)
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
