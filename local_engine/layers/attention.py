"""Paged attention: per step metadata and the layer that stores K/V and attends over the block tables.

Tokens of a step are packed: the first `num_decode_tokens` are decode tokens (one per sequence, context already
cached), the rest are prefill chunks. Both halves read their keys from the paged cache after this step's K/V
were stored, so a chunk attends to its own tokens and to everything computed in earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from local_engine.layers.backend import Ops

__all__ = ["Attention", "AttentionMetadata"]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [B, MAXB] int32
    decode_context_lens: torch.Tensor | None  # [B] int32
    prefill_block_tables: torch.Tensor | None  # [S, MAXB] int32
    prefill_cu_seqlens_q: torch.Tensor | None  # [S + 1] int32
    prefill_context_lens: torch.Tensor | None  # [S] int32
    prefill_max_seqlen_q: int

    @classmethod
    def one_prefill(cls, num_tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
        """One sequence's prefill of `num_tokens` tokens from position 0 into KV blocks 0, 1, ... (a scratch or
        whole-cache pass: the profiling step, perplexity)."""
        num_blocks = -(-num_tokens // block_size)
        return cls(
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_context_lens=None,
            prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
            prefill_cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            prefill_context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            prefill_max_seqlen_q=num_tokens,
        )


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: Ops) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.ops = ops
        # Views into the engine's one KV tensor, set by the model runner once the cache is allocated; with an int8
        # cache, also views into its scales [num_blocks, KVH] (None for a float cache).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        k_scale, v_scale = self.k_scale, self.v_scale
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, k_scale, v_scale)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            return self._decode(q, meta)
        tables, cu_seqlens_q, context_lens = (
            meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q,
            meta.prefill_context_lens,
        )
        assert tables is not None and cu_seqlens_q is not None and context_lens is not None  # set for prefill rows
        prefill = self.ops.paged_prefill_attention(
            q[num_decode:],
            self.k_cache,
            self.v_cache,
            tables,
            cu_seqlens_q,
            context_lens,
            meta.prefill_max_seqlen_q,
            self.scale,
            k_scale,
            v_scale,
        )
        if num_decode == 0:
            return prefill
        return torch.cat((self._decode(q[:num_decode], meta), prefill), dim=0)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows (one query token per sequence) over their blocks."""
        tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and context_lens is not None  # set for decode rows
        return self.ops.paged_decode_attention(
            q,
            self.k_cache,
            self.v_cache,
            tables,
            context_lens,
            self.scale,
            self.k_scale,
            self.v_scale,
        )
