"""Fused RMSNorm, optionally with the residual add in front of it (one read of x and residual, float32 math)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import check_last_dim_contiguous, check_same_device, kernel_for, pow2_at_least

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the model dtype before normalising it, as an unfused `x + residual` would.
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / hidden_size
    rstd = 1.0 / tl.sqrt(mean_square + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`out = x * rsqrt(mean(x^2) + eps) * weight` over the last dim of `x` `[T, H]`; float32 math, x's dtype out.

    With `residual`: `x = x + residual` first, returned as the second element (the next layer's residual);
    without: the second element is None. Inputs are never modified. Tolerance vs the reference: ~1e-5 in float32;
    one bf16 ulp (~1e-2 relative) in bfloat16 on GPU.
    """
    name = "rms_norm"
    tensors = (x, weight) if residual is None else (x, weight, residual)
    device = check_same_device(name, *tensors)
    assert x.dim() == 2, f"{name}: x must be [T, hidden], got {tuple(x.shape)}; flatten leading dims first"
    num_tokens, hidden_size = x.shape
    assert weight.shape == (hidden_size,), f"{name}: weight must be [{hidden_size}], got {tuple(weight.shape)}"
    assert weight.is_contiguous(), f"{name}: weight must be contiguous"
    check_last_dim_contiguous(name, "x", x)
    if residual is not None:
        assert residual.shape == x.shape, f"{name}: residual {tuple(residual.shape)} must match x {tuple(x.shape)}"
        assert residual.dtype == x.dtype, f"{name}: residual is {residual.dtype} but x is {x.dtype}"
        check_last_dim_contiguous(name, "residual", residual)
    assert hidden_size <= 65536, f"{name}: hidden size {hidden_size} exceeds the one-block limit of 65536"

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    kernel_for(_rms_norm_kernel, device)[(num_tokens,)](
        x,
        x if residual is None else residual,  # unread without HAS_RESIDUAL; any pointer will do
        weight,
        out,
        out if residual_out is None else residual_out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        out.stride(0) if residual_out is None else residual_out.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=pow2_at_least(hidden_size),
        num_warps=min(max(pow2_at_least(hidden_size) // 512, 1), 16),
    )
    return out, residual_out
