"""Dequantizing matmul for weight-only quantized projections: w8a16 and w4a16 (`local_engine/quantization.py`).

    out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]),   w = scale[n] * q          (int8, per output channel)
                                                         w = scale[n, g] * q + min[n, g]   (int4, g = k // group)

Each program computes a [BLOCK_M, BLOCK_N] tile of the output, walking K in steps of BLOCK_K: it loads the
quantized weights of the step (int8, or the bytes holding two 4-bit weights each), dequantizes them in registers
to float32 and accumulates `x @ w.T` in float32; the weights never exist as floats in memory. x is float16,
bfloat16 or float32 (the "a16" is the activations' dtype); out has x's dtype.

Tolerance vs `quantization.reference_linear` (dequantize then `F.linear`): float32 ~1e-5 relative (summation
order). With bfloat16 activations the sums are float32 rounded once to bfloat16: compiled (GPU), the weights are
rounded to bfloat16 like the reference's; interpreted (CPU tests), they stay float32 and the output is within one
bfloat16 ulp of the float32 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from local_engine.kernels.launch import kernel_for

__all__ = ["quant_matmul"]


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    mins_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_om,
    num_groups,
    GROUP: tl.constexpr,
    IS_INT4: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_16BIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not IS_INT4:
        row_scale = tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K], x's dtype
        w_mask = mask_k[:, None] & mask_n[None, :]
        if IS_INT4:
            # [BLOCK_K, BLOCK_N]: byte k // 2 of row n, low nibble for even k, high for odd
            byte = tl.load(
                q_ptr + offs_n[None, :].to(tl.int64) * stride_qn + (offs_k // 2)[:, None], mask=w_mask, other=0
            )
            q = ((byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 15).to(tl.float32)
            group = offs_n[None, :].to(tl.int64) * num_groups + (offs_k // GROUP)[:, None]
            scale = tl.load(scales_ptr + group, mask=w_mask, other=0.0)
            low = tl.load(mins_ptr + group, mask=w_mask, other=0.0)
            w = q * scale + low
        else:
            q = tl.load(q_ptr + offs_n[None, :].to(tl.int64) * stride_qn + offs_k[:, None], mask=w_mask, other=0)
            w = q.to(tl.float32) * row_scale[None, :]
        if DOT_16BIT:  # the weights rounded to x's dtype, as the reference's are: bf16/fp16 tensor cores, fp32 sums
            acc += tl.dot(x, w.to(x.dtype))
        else:  # float32; and 16-bit x in the interpreter, which has no 16-bit dot (weights kept in float32 there)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    num_in: int,
    group_size: int = 0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, dequantize(weight), bias)` for x [M, K] (rows may be apart, unit column stride) and a weight
    given as `quantization.QuantizedWeight`'s tensors: int8 [N, K] with float32 scales [N] (w8a16), or uint8
    [N, K / 2] with float32 scales and mins [N, groups] of `group_size` (w4a16). Returns [M, N] in x's dtype."""
    name = "quant_matmul"
    is_int4 = qweight.dtype == torch.uint8
    assert x.dim() == 2 and x.shape[1] == num_in, f"{name}: x must be [M, {num_in}], got {tuple(x.shape)}"
    assert qweight.dtype in (torch.int8, torch.uint8) and qweight.is_contiguous(), f"{name}: qweight"
    assert scales.dtype == torch.float32 and scales.is_contiguous(), f"{name}: scales must be contiguous float32"
    assert not is_int4 or (mins is not None and mins.is_contiguous() and group_size > 0), f"{name}: int4 needs mins"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_rows, num_out = x.shape[0], qweight.shape[0]
    out = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_out == 0:
        return out
    block_m = 16 if num_rows <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    kernel_for(_quant_matmul_kernel, x.device)[grid](
        x,
        qweight,
        scales,
        mins if mins is not None else scales,
        bias if bias is not None else scales,
        out,
        num_rows,
        num_out,
        num_in,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        scales.shape[1] if is_int4 else 1,
        GROUP=group_size if is_int4 else 1,
        IS_INT4=is_int4,
        HAS_BIAS=bias is not None,
        DOT_16BIT=x.dtype != torch.float32 and x.device.type == "cuda",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
