"""The launchers of the native CPU kernels: each takes torch tensors, checks that they are what its C kernel
handles (float32 on CPU, the strides and limits the kernel was written for; the KV cache float32, or int8 with its
float32 scales per (block, KV head)) and calls it through the declarations of `library.SIGNATURES`. Where the
kernels cannot be built, or a call is outside what they handle (another dtype, shapes past their limits), a
launcher returns None (False for the in-place ones) and does nothing: the caller takes the torch path (`cpu_ops`
does so for the six engine operations, `layers/linear.py` for projections).
"""

from __future__ import annotations

import numpy as np
import torch

from local_engine.kernels.cpu.library import Kernel, load

__all__ = [
    "BLOCK_FORMATS",
    "WEIGHTS_F32",
    "WEIGHTS_Q4_1",
    "WEIGHTS_Q8_0",
    "apply_rotary",
    "linear",
    "pack_block_weight",
    "pack_linear_weight",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "unpack_block_weight",
]

# Weight formats of the projection panels (`WEIGHTS_*` in kernels.c): float32, or a GGUF file's own blocks.
WEIGHTS_F32 = 0
WEIGHTS_Q4_1 = 1
WEIGHTS_Q8_0 = 2
BLOCK_FORMATS = {"Q4_1": WEIGHTS_Q4_1, "Q8_0": WEIGHTS_Q8_0}  # GGUF type name -> format
_BLOCK_BYTES = {WEIGHTS_Q4_1: 20, WEIGHTS_Q8_0: 34}  # bytes of one block of 32 weights in the GGUF file
_PANEL_BLOCK_BYTES = {WEIGHTS_Q4_1: 24, WEIGHTS_Q8_0: 36}  # bytes per block of 32 and output feature, packed


def _scales_fit(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """A float32 cache without scales, or an int8 one with float32 scales [num_blocks, KVH] (contiguous)."""
    if k_cache.dtype == v_cache.dtype == torch.float32:
        return k_scale is None and v_scale is None
    if not (k_cache.dtype == v_cache.dtype == torch.int8 and k_scale is not None and v_scale is not None):
        return False
    shape = (k_cache.shape[0], k_cache.shape[2])
    return all(s.dtype == torch.float32 and s.shape == shape and s.is_contiguous() for s in (k_scale, v_scale))


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _applies(
    kernel: Kernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and _scales_fit(k_cache, v_cache, k_scale, v_scale)
        and block_tables.dtype == context_lens.dtype == torch.int32
        and q.stride(2) == 1
        and q.stride(1) == head_dim  # the heads of a token side by side; tokens may be apart (a qkv view)
        and all(t.is_contiguous() for t in (k_cache, v_cache, block_tables, context_lens))
        and num_heads <= kernel.max_heads
        and num_heads // num_kv_heads <= kernel.max_group
        and head_dim % kernel.lanes == 0  # whole vectors: 16 floats with AVX-512, else 8
        and head_dim <= kernel.max_head_dim
        and block_size <= kernel.max_block_size
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The signature of `torch_ops.paged_decode_attention`; None when the kernel is unavailable or the inputs
    are outside what it handles (the caller then takes the torch path)."""
    kernel = load()
    if kernel is None or not _applies(kernel, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale):
        return None
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype)
    if num_seqs:
        kernel.decode(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            k_cache.shape[2],
            head_dim,
            k_cache.shape[1],
            block_tables.shape[1],
            scale,
            _pointer(k_scale),
            _pointer(v_scale),
        )
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
) -> torch.Tensor | None:
    """The signature of `torch_ops.paged_prefill_attention`; None when the kernel is unavailable or the inputs are
    outside what it handles (head dims that are not a multiple of the vector width included). Raises MemoryError
    when the kernel cannot allocate its scratch (the sequences' transposed keys) rather than return unwritten rows."""
    del max_seqlen_q  # the kernel splits each sequence into tasks itself
    kernel = load()
    if (
        kernel is None
        or not _applies(kernel, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
        or q.shape[2] % kernel.lanes
        or cu_seqlens_q.dtype != torch.int32
        or not cu_seqlens_q.is_contiguous()
        or cu_seqlens_q.shape != (context_lens.shape[0] + 1,)
    ):
        return None
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    if num_tokens and kernel.prefill(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        context_lens.shape[0],
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
        _pointer(k_scale),
        _pointer(v_scale),
    ):
        raise MemoryError("prefill attention: out of memory for the sequences' transposed keys")
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """`torch_ops.apply_rotary` in place; False (nothing done) when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None:
        return False
    num_tokens, num_heads, head_dim = q.shape
    if not (
        q.device.type == "cpu"
        and q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[1] == head_dim
        and head_dim % 2 == 0
        and q.stride(2) == k.stride(2) == 1
        and q.stride(1) == k.stride(1) == head_dim
    ):
        return False
    if num_tokens:
        kernel.rotary(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            positions.data_ptr(),
            cos_sin_cache.data_ptr(),
            num_tokens,
            num_heads,
            k.shape[1],
            head_dim,
        )
    return True


def _rows_and_vector(x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None) -> bool:
    """The inputs the row kernels (`linear`, `rms_norm`) take: float32 rows on CPU with unit column stride (rows
    may be apart), a contiguous float32 weight, and an optional contiguous float32 bias or residual."""
    return weight.dtype == torch.float32 and weight.is_contiguous() and _rows(x, extra)


def _rows(x: torch.Tensor, extra: torch.Tensor | None) -> bool:
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and (extra is None or (extra.dtype == torch.float32 and extra.is_contiguous()))
    )


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 [N, K] weight in the layout `linear` reads: panels of `panel_width` output features, [ceil(N /
    width), K, width], the last panel zero-padded (a copy; the weight's own bytes plus at most one panel). None
    when the kernel is unavailable or the weight is not a 2-D float32 CPU tensor."""
    kernel = load()
    if kernel is None or weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    (num_out, num_in), width = weight.shape, kernel.panel_width
    panels = -(-num_out // width)
    padded = torch.zeros((panels * width, num_in), dtype=torch.float32)
    padded[:num_out] = weight
    return padded.view(panels, width, num_in).transpose(1, 2).contiguous()


def pack_block_weight(blocks: np.ndarray, weight_format: int, num_in: int) -> torch.Tensor | None:
    """A GGUF tensor's raw blocks, [N, num_in / 32 * block bytes] uint8 (Q4_1: fp16 d, fp16 m, 16 bytes of 4-bit
    q, the first 16 weights in the low nibbles; Q8_0: fp16 d, 32 int8 q), in the layout `linear` reads with
    `weight_format`: per panel of `panel_width` outputs, per block of 32 along K, the scales as float32 for the
    whole panel, then the quants with each row of the block side by side (Q4_1: one byte per output holds
    weights 2i and 2i + 1, so the kernel walks K in order) — [panels, num_in / 32, 24 or 36 x width] uint8, the
    last panel's padding all zero. None when the kernel is unavailable or the shapes do not fit."""
    kernel = load()
    block_bytes = _BLOCK_BYTES.get(weight_format)
    if kernel is None or block_bytes is None or num_in % 32 or blocks.ndim != 2 or blocks.dtype != np.uint8:
        return None
    num_out, num_blocks, width = blocks.shape[0], num_in // 32, kernel.panel_width
    if blocks.shape[1] != num_blocks * block_bytes:
        return None
    panels = -(-num_out // width)
    padded = np.zeros((panels * width, num_blocks, block_bytes), dtype=np.uint8)
    padded[:num_out] = blocks.reshape(num_out, num_blocks, block_bytes)

    def by_panel(values: np.ndarray) -> np.ndarray:  # [N, blocks, *rest] -> [panels, blocks, *rest, width] bytes
        moved = values.reshape(panels, width, num_blocks, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(moved).reshape(panels, num_blocks, -1).view(np.uint8)

    def scales(offset: int) -> np.ndarray:  # fp16 at `offset` of each block -> float32 (exact)
        return by_panel(np.ascontiguousarray(padded[:, :, offset : offset + 2]).view(np.float16).astype(np.float32))

    if weight_format == WEIGHTS_Q4_1:
        packed_q = padded[:, :, 4:]
        q = np.concatenate([packed_q & 15, packed_q >> 4], axis=-1)  # [N, blocks, 32], along K
        parts = [scales(0), scales(2), by_panel(q[..., 0::2] | (q[..., 1::2] << 4))]
    else:
        parts = [scales(0), by_panel(padded[:, :, 2:])]
    packed = np.concatenate(parts, axis=-1)
    assert packed.shape == (panels, num_blocks, _PANEL_BLOCK_BYTES[weight_format] * width)
    return torch.from_numpy(packed)


def _panels_fit(packed: torch.Tensor, weight_format: int, num_out: int, num_in: int, kernel: Kernel) -> bool:
    """Whether `packed` holds [num_out, num_in] in `weight_format`'s panels, as `pack_linear_weight` or
    `pack_block_weight` lay them out."""
    width = kernel.panel_width
    if packed.dim() != 3 or not packed.is_contiguous():
        return False
    if weight_format == WEIGHTS_F32:
        fits = packed.dtype == torch.float32 and packed.shape[1:] == (num_in, width)
    else:
        block = _PANEL_BLOCK_BYTES.get(weight_format)
        fits = block is not None and packed.dtype == torch.uint8 and packed.shape[1:] == (num_in // 32, block * width)
        fits = fits and num_in % 32 == 0
    return fits and (packed.shape[0] - 1) * width < num_out <= packed.shape[0] * width


def unpack_block_weight(packed: torch.Tensor, weight_format: int, num_out: int, num_in: int) -> torch.Tensor | None:
    """The float32 weight [num_out, num_in] that block panels (`pack_block_weight`) stand for, exactly the values
    the kernel dequantizes to (Q8_0 w = d * q; Q4_1 w = d * q + m); None when the kernel is unavailable or the
    panels do not fit the shape."""
    kernel = load()
    if kernel is None or weight_format == WEIGHTS_F32:
        return None
    if not _panels_fit(packed, weight_format, num_out, num_in, kernel):
        return None
    out = torch.empty((num_out, num_in), dtype=torch.float32)
    if kernel.unpack_blocks(packed.data_ptr(), weight_format, num_out, num_in, out.data_ptr()):
        return None
    return out


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    num_out: int,
    bias: torch.Tensor | None,
    weight_format: int = WEIGHTS_F32,
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for x [M, K] (rows may be apart: a slice of a fused projection), float32 on
    CPU, with the weight [num_out, K] given packed (`pack_linear_weight`, or `pack_block_weight` with its
    `weight_format`); None when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None or not _rows(x, bias) or packed.dim() != 3:
        return None
    num_in = x.shape[1]
    if not _panels_fit(packed, weight_format, num_out, num_in, kernel) or (
        bias is not None and bias.shape != (num_out,)
    ):
        return None
    num_rows = x.shape[0]
    out = torch.empty((num_rows, num_out), dtype=torch.float32)
    if num_rows and kernel.linear(
        x.data_ptr(),
        x.stride(0),
        num_rows,
        packed.data_ptr(),
        weight_format,
        num_out,
        num_in,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
    ):
        raise MemoryError("the native linear kernel could not allocate its dequantized panel")
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`torch_ops.rms_norm` in one pass per row (the residual add included); None when the kernel is unavailable or
    does not apply. With `residual`, the sum is written into `residual` and the result into `x` (the model passes
    a fresh projection output and its running sum, neither used again); without, into a new tensor."""
    kernel = load()
    if (
        kernel is None
        or not _rows_and_vector(x, weight, residual)
        or weight.shape != (x.shape[1],)
        or (residual is not None and residual.shape != x.shape)
    ):
        return None
    out = x if residual is not None else torch.empty(x.shape, dtype=torch.float32)
    if x.numel():
        kernel.rms_norm(
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            x.shape[1],
            eps,
        )
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """`torch_ops.silu_and_mul` (in place in the gate half of `x`, which it returns); None when the kernel is
    unavailable or does not apply."""
    kernel = load()
    if kernel is None or x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1 or x.shape[1] % 2:
        return None
    inter = x.shape[1] // 2
    if x.numel():
        kernel.silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], inter)
    return x[:, :inter]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """`torch_ops.store_kv` (an int8 cache by the rule of `kernels/reference.py`, byte for byte); False (nothing
    done) when the kernel is unavailable or does not apply."""
    kernel = load()
    if kernel is None:
        return False
    num_tokens, num_kv_heads, head_dim = k.shape
    if not (
        k.dtype == v.dtype == torch.float32
        and _scales_fit(k_cache, v_cache, k_scale, v_scale)
        and head_dim <= kernel.max_head_dim
        and k.device.type == "cpu"
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == head_dim
        and k_cache.shape[2:] == v_cache.shape[2:] == (num_kv_heads, head_dim)
    ):
        return False
    if num_tokens and k_scale is not None and v_scale is not None:
        kernel.store_kv_int8(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_scale.data_ptr(),
            v_scale.data_ptr(),
            slot_mapping.data_ptr(),
            num_tokens,
            num_kv_heads,
            head_dim,
            k_cache.shape[1],
        )
    elif num_tokens:
        kernel.store_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            num_tokens,
            num_kv_heads * head_dim,
        )
    return True
