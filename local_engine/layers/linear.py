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
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "is_packing_available", "pack_linears"]


def is_packing_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's packed layout (an opaque tensor, so not a parameter or buffer:
    `.to()` and `state_dict()` must not touch it). Same input/output contract: [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.num_bytes = weight.numel() * weight.element_size()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` in `model` (CPU, float32 or bfloat16) for a `PackedLinear`; returns how many.
    Tied weights stay shared where they are still used elsewhere (an embedding keeps its own tensor)."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.device.type == "cpu"
                and child.weight.dtype in (torch.float32, torch.bfloat16)
            ):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
