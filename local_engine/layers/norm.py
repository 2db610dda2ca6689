"""RMSNorm as a module holding its weight; the math lives in the selected ops (optionally fused with the add)."""

from __future__ import annotations

import torch
from torch import nn

from local_engine.layers.backend import Ops

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
