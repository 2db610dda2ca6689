"""Plain torch references for every kernel: the same signatures and semantics, written to be obviously correct.

Slow on purpose (per-sequence Python loops, float32 everywhere); the kernels are tested against these. The int8
KV cache's rule (how `store_kv` keeps a scale per block and KV head) is defined here, below `store_kv`.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_rotary",
    "dequantize_blocks",
    "gather_kv",
    "kv_runs",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "store_run_int8",
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
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.dtype == torch.int8:
        assert k_scale is not None and v_scale is not None, "an int8 KV cache needs its scales"
        for run in kv_runs(slot_mapping.tolist(), k_cache.shape[1]):
            store_run_int8(k[run], k_cache, k_scale, [int(s) for s in slot_mapping[run]])
            store_run_int8(v[run], v_cache, v_scale, [int(s) for s in slot_mapping[run]])
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


# -- the int8 KV cache ------------------------------------------------------------------------------------------------
#
# Each (block, KV head) has one float32 scale; element q reads as q * scale, q in [-127, 127]. A write takes the
# tokens in order, in runs: consecutive tokens whose slots lie in one block (the engine writes a block from one
# sequence only, so a step's tokens of a block are always consecutive). For each run and KV head:
#   base  = 0 when the run writes the block's offset 0 (a block is filled from offset 0: nothing older is valid),
#           else the block's current scale
#   scale = max(base, max |x| over the run's tokens / 127)                      (a scale only grows)
#   when the scale grew, the entries at offsets below the run's first one are requantized: round(q * base / scale)
#   the run's tokens are stored as round(x / scale) (round half to even, clamped to [-127, 127]; 0 when scale = 0)
# A prefill chunk is quantized once with its block's whole range; a decode token that exceeds the range costs one
# requantization of the block's earlier entries (error <= 1 step of the new scale for those, 0.5 step otherwise).


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Float32 values already divided by their scale -> int8: round half to even, clamp to [-127, 127]."""
    return torch.round(x).clamp_(-127, 127).to(torch.int8)


def kv_runs(slots: list[int], block_size: int) -> list[list[int]]:
    """Token indices in runs of consecutive tokens with slots in the same block (slot -1 skipped, ends a run)."""
    runs: list[list[int]] = []
    last = -1
    for t, slot in enumerate(slots):
        if slot < 0:
            last = -1
            continue
        block = slot // block_size
        if block == last:
            runs[-1].append(t)
        else:
            runs.append([t])
        last = block
    return runs


def store_run_int8(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: list[int]) -> None:
    """One run's tokens x [n, KVH, D] into their slots of one block of an int8 cache, by the rule above."""
    block_size = cache.shape[1]
    block = slots[0] // block_size
    offsets = [s % block_size for s in slots]
    base = torch.zeros_like(scales[block]) if 0 in offsets else scales[block].clone()  # [KVH]
    new = torch.maximum(base, x.float().abs().amax(dim=(0, 2)) / 127.0)
    inv = torch.where(new > 0, 1.0 / new, torch.zeros_like(new))
    first = min(offsets)
    grew = (base > 0) & (new > base)
    if first > 0 and bool(grew.any()):
        old = cache[block, :first].float()  # [first, KVH, D]
        requantized = quantize(old * (base * inv)[None, :, None])
        cache[block, :first] = torch.where(grew[None, :, None], requantized, cache[block, :first])
    cache[block, offsets] = quantize(x.float() * inv[None, :, None])
    scales[block] = new


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Cache blocks [..., block_size, KVH, D] as float32; int8 ones times their scales [..., KVH]."""
    if scales is None:
        return blocks.float()
    return blocks.float() * scales.unsqueeze(-2).unsqueeze(-1)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scales: torch.Tensor | None = None
) -> torch.Tensor:  # [context_len, num_kv_heads, head_dim], float32
    """The first `context_len` tokens of one sequence, read block by block through its block table (float32;
    an int8 cache dequantized with its per-(block, head) `scales`)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    ids = [int(block_id) for block_id in block_table[:num_blocks]]
    blocks = [dequantize_blocks(cache[i], None if scales is None else scales[i]) for i in ids]
    if not blocks:
        return cache.new_zeros((0, *cache.shape[2:]), dtype=torch.float32)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    for seq, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[seq], context_len, k_scale)
        v = gather_kv(v_cache, block_tables[seq], context_len, v_scale)
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[seq], bounds[seq + 1]
        if start == end:
            continue
        assert end - start <= max_seqlen_q
        k = gather_kv(k_cache, block_tables[seq], context_len, k_scale)
        v = gather_kv(v_cache, block_tables[seq], context_len, v_scale)
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
