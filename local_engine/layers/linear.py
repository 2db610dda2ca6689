"""CPU projections through oneDNN with weights packed once at load time.

On this project's reference CPU (AMD EPYC, 2 threads) `F.linear` goes to MKL's sgemm, which runs AMD parts on a
slow code path and re-reads cold weights poorly at decode sizes. oneDNN's matmul on a weight pre-packed into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the path Inductor's CPU freezing uses) was measured
on SmolLM2-135M's layer shapes in float32, weights cold as in a real step:

    rows (tokens)        1      8     32      2048
    F.linear (MKL)   24.9 ms  41.3   77.3   2,077   (all 30 layers' projections)
    oneDNN packed    11.3 ms  13.2   22.2     972

Results agree with `F.linear` to float32 rounding (same math, another summation order). Packing is used only on
CPU for float32/bfloat16 weights, when the torch build has oneDNN; `EngineConfig.pack_cpu_weights=False` keeps
plain `nn.Linear` (to compare).

Decode batches are projections of a few rows, where every step streams all the weights from memory and the
libraries' small-M paths reach about half the read bandwidth. With the native CPU kernels on, a `PackedLinear`
also keeps the weight in torch's row-major layout and sends calls of up to `NATIVE_MAX_ROWS` rows to
`cpu_kernels.linear`, which streams it at memory speed. Measured on the same 30 layers, weights cold, in ms, on an
AVX2-only EPYC (slower than the host of the table above, whose oneDNN had AVX-512):

    rows                     1      8     16     24     32
    oneDNN packed         39.8   57.9   68.8   79.5   95.1
    cpu_kernels.linear    25.1   30.4   51.2   69.9   94.0

The row-major copy costs the projections' bytes a second time (a tied output embedding shares the input
embedding's tensor and costs nothing); the engine counts it in its weights memory.
"""

from __future__ import annotations

import torch
from torch import nn

from local_engine.layers import cpu_kernels

__all__ = ["NATIVE_MAX_ROWS", "PackedLinear", "can_pack", "is_packing_available", "pack_linears"]

# Up to this many rows a call goes to the native kernel (it leads oneDNN by 12% at 24 rows and ties it at 32).
NATIVE_MAX_ROWS = 24


def is_packing_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def can_pack(dtype: torch.dtype) -> bool:
    """float32 always (with oneDNN); bfloat16 only where oneDNN has a bf16 path on this CPU (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT: its reorder refuses others, e.g. AVX2-only parts)."""
    if not is_packing_available():
        return False
    if dtype == torch.float32:
        return True
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and is_supported is not None and bool(is_supported())


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's packed layout (an opaque tensor, so not a parameter or buffer:
    `.to()` and `state_dict()` must not touch it). Same input/output contract: [..., in] -> [..., out].

    With `native_max_rows` > 0 the row-major weight is kept as well, and 2-D inputs of at most that many rows go
    to `cpu_kernels.linear` (float32; anything it does not take stays on oneDNN)."""

    def __init__(self, linear: nn.Linear, native_max_rows: int = 0, shared: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.num_bytes = weight.numel() * weight.element_size()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.native_max_rows = native_max_rows if weight.dtype == torch.float32 else 0
        self.weight = weight.contiguous() if self.native_max_rows else None
        # Bytes beyond the model's parameters: the packed copy, unless it replaces the only row-major one (a
        # `shared` weight, tied to an embedding, lives on in the embedding).
        self.extra_bytes = self.num_bytes if self.weight is not None or shared else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.dim() == 2 and x.shape[0] <= self.native_max_rows:
            out = cpu_kernels.linear(x, self.weight, self.bias)
            if out is not None:
                return out
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, native_max_rows: int = 0) -> int:
    """Swap every `nn.Linear` in `model` (CPU, float32 or bfloat16: see `can_pack`) for a `PackedLinear`, each
    keeping its row-major weight too for calls of up to `native_max_rows` rows (0: never); returns how many.
    Tied weights stay shared where they are still used elsewhere (an embedding keeps its own tensor)."""
    swapped = 0
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and can_pack(child.weight.dtype):
                shared = id(child.weight) in elsewhere
                setattr(parent, name, PackedLinear(child, native_max_rows, shared))
                swapped += 1
    return swapped
