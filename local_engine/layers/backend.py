"""The six engine operations as one seam (`Ops`), and the choice of their implementation by name: "torch"
(`layers/torch_ops.py`, optionally through the native CPU kernels of `kernels/cpu/`) or "triton" (`kernels/`).

Four modules implement `Ops`: `layers.torch_ops`, `kernels.cpu.cpu_ops`, `kernels` (the Triton launchers) and
`kernels.reference` (the plain torch references the kernels are tested against). They satisfy it as modules, by
structure; a test checks that each has every operation with the protocol's parameter names.
"""

from __future__ import annotations

from typing import Protocol

import torch

from local_engine.errors import ModelLoadError

__all__ = ["Ops", "select_ops"]


class Ops(Protocol):
    """The operations the model calls, identical in signature across implementations. KV cache layout per layer:
    `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is `block_id * block_size + offset`.

    The cache holds the model dtype, bfloat16/float16 (read as the query's dtype), or int8 with a float32 scale per
    (block, KV head) in `k_scale` / `v_scale` `[num_blocks, num_kv_heads]` (None for a float cache): an element
    reads as `q * scale`. `store_kv` keeps those scales valid (`kernels/reference.py` states the rule)."""

    # The implementing module's name: the engine reports its last part ("torch_ops", "cpu_ops" or "kernels").
    __name__: str

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write k, v [T, KVH, D] into their cache slots; slot -1 skips the token."""
        ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per sequence over its whole context: q [B, H, D] -> [B, H, D]."""
        ...

    def paged_prefill_attention(
        self,
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
        """Packed variable-length causal prefill over the paged cache: q [T, H, D] -> [T, H, D]."""
        ...

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm; with `residual`, x + residual is normalised and returned as the new residual."""
        ...

    def apply_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
    ) -> None:
        """Rotary embedding on q [T, H, D] and k [T, KVH, D], in place."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[:, :I]) * x[:, I:]; may overwrite `x`, which the model never reads again."""
        ...


def select_ops(attention_backend: str, *, native_cpu: bool = False) -> Ops:
    """The implementation of the six operations for `attention_backend` ("torch" or "triton"). `native_cpu`:
    the torch ops through the C kernels of `kernels/cpu/` (`cpu_ops`), when they build on this machine."""
    if attention_backend == "torch":
        from local_engine.kernels import cpu
        from local_engine.layers import torch_ops

        if native_cpu and cpu.is_available():
            from local_engine.kernels.cpu import cpu_ops

            return cpu_ops
        return torch_ops
    if attention_backend == "triton":
        import local_engine.kernels as kernels

        if not kernels.is_triton_available():
            raise ModelLoadError("attention_backend 'triton' needs triton and a CUDA device; use 'torch' instead")
        return kernels
    raise ModelLoadError(f"unknown attention_backend {attention_backend!r} (use 'torch' or 'triton')")
