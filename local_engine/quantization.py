"""Weight-only quantization at load time, for any checkpoint: int8 per output channel, int4 in groups.

    int8  w[n, k] ≈ scale[n] * q[n, k]                    q int8 in [-127, 127], symmetric
    int4  w[n, k] ≈ scale[n, g] * q[n, k] + min[n, g]     q in [0, 15], g = k // group_size (the last group may
                                                          be shorter), two per byte: byte j holds k = 2j in its low
                                                          nibble and k = 2j + 1 in its high one

Scales and minimums are float32 holding float16 values: the formats are then exactly a GGUF file's Q8_0 (one
scale per 32 weights; here every block of a row shares the row's scale) and Q4_1 (a scale and a minimum per 32
weights; a group of 64 or 128 is two or four blocks with the same pair), so the native CPU kernel's block panels
(`kernels/cpu`, `pack_block_weight`) read them as they read a GGUF's own blocks (`to_gguf_blocks`).

In a state dict a quantized weight `X.weight` is stored as `X.qweight`, `X.scales` and (int4) `X.mins`;
`split_quantized` gathers them back into `QuantizedWeight`s. The reference for every path is `dequantize` then
`F.linear` (`reference_linear`); the CPU kernels and the Triton kernel (`kernels/quant_matmul.py`) are tested
against it. Which weights: the decoder's projections and `lm_head` (tied embeddings: the embedding stays float
for the lookup, `lm_head` gets a quantized copy; with int4 the head is int8: `HEAD_METHOD`); embeddings, norms
and biases stay float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from local_engine.errors import ModelLoadError

__all__ = [
    "HEAD_METHOD",
    "QUANTIZED_SUFFIXES",
    "QuantizationSpec",
    "QuantizedWeight",
    "dequantize",
    "fp16_exact",
    "quantize",
    "quantize_state_dict",
    "reference_linear",
    "split_quantized",
    "to_gguf_blocks",
]

QUANTIZED_SUFFIXES = (".qweight", ".scales", ".mins")
# The output head's method for each setting: int4 keeps it in int8, as llama.cpp's 4-bit mixes keep their output
# tensor at 6-8 bits. On the bundled SmolLM2-135M (tied embeddings) an int4 head alone cost +6.0% perplexity over
# the evaluation text's first 2,048 tokens; in int8, with every projection in int4 (which in groups of 32 gives back
# the file's own Q4_1 projections), +0.02% (`benchmarks/
# quantization.py`), for 10 MiB more.
HEAD_METHOD: dict[str, Literal["int8", "int4"]] = {"int8": "int8", "int4": "int8"}
# The decoder's projections (HF names) and the output head: what gets quantized.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class QuantizationSpec:
    """`EngineConfig.quantization` / `quantization_group_size` as the loader takes them."""

    method: Literal["int8", "int4"]
    group_size: int = 32  # int4 only

    @property
    def tag(self) -> str:
        """Names the variant in the weights cache: `int8`, `int4-g32`."""
        return "int8" if self.method == "int8" else f"int4-g{self.group_size}"


@dataclass
class QuantizedWeight:
    """One quantized [num_out, num_in] weight (see the module docstring for the formats)."""

    method: Literal["int8", "int4"]
    qweight: torch.Tensor  # int8 [N, K] | uint8 [N, ceil(K / 2)]
    scales: torch.Tensor  # float32 [N] | [N, num_groups]
    mins: torch.Tensor | None  # int4: float32 [N, num_groups]
    num_in: int
    group_size: int = 0  # int4 only

    @property
    def num_out(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def num_bytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedWeight(
            self.method, self.qweight.to(device), self.scales.to(device), mins, self.num_in, self.group_size
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Shards stacked along the output rows (q/k/v into qkv): per-row quantities, so the same as quantizing the
        fused weight."""
        first = parts[0]
        assert all((p.method, p.num_in, p.group_size) == (first.method, first.num_in, first.group_size) for p in parts)
        mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
        return QuantizedWeight(
            first.method,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.num_in,
            first.group_size,
        )


def fp16_exact(values: torch.Tensor) -> torch.Tensor:
    """Rounded to the nearest float16 (kept as float32), so Q8_0 / Q4_1 blocks hold them exactly."""
    return values.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).to(torch.float32)


def quantize(weight: torch.Tensor, spec: QuantizationSpec) -> QuantizedWeight:
    """Quantize a 2-D float weight [N, K] (computed in float32)."""
    w = weight.detach().to(torch.float32)
    assert w.dim() == 2, f"quantize takes a 2-D weight, got {tuple(w.shape)}"
    if spec.method == "int8":
        return _quantize_int8(w)
    return _quantize_int4(w, spec.group_size)


def _quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    scales = fp16_exact(w.abs().amax(dim=1) / 127.0)
    # float16 rounding may put the largest weight a hair past 127 steps: clamp (its error stays under half a step)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales, None, int(w.shape[1]))


def _quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    num_out, num_in = w.shape
    num_groups = -(-num_in // group_size)
    # A short last group is padded with copies of its last weight: they never widen its range past its values.
    padded = torch.cat((w, w[:, -1:].expand(num_out, num_groups * group_size - num_in)), dim=1)
    grouped = padded.view(num_out, num_groups, group_size)
    mins = fp16_exact(grouped.amin(dim=2))
    scales = fp16_exact((grouped.amax(dim=2) - mins) / 15.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((grouped - mins[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.view(num_out, -1)[:, :num_in]
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return QuantizedWeight("int4", packed.contiguous(), scales, mins, int(num_in), group_size)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] the quantized one stands for (float32 math, then `dtype`)."""
    if qw.method == "int8":
        return (qw.qweight.to(torch.float32) * qw.scales[:, None]).to(dtype)
    assert qw.mins is not None
    q = torch.stack((qw.qweight & 15, qw.qweight >> 4), dim=-1).view(qw.num_out, -1)[:, : qw.num_in]
    groups = torch.arange(qw.num_in, device=q.device) // qw.group_size
    return (q.to(torch.float32) * qw.scales[:, groups] + qw.mins[:, groups]).to(dtype)


def reference_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of every quantized path: dequantize to x's dtype, then `F.linear`."""
    return F.linear(x, dequantize(qw, x.dtype), bias)


def to_gguf_blocks(qw: QuantizedWeight) -> tuple[str, np.ndarray] | None:
    """The weight as a GGUF tensor's raw blocks of 32 along K (type name, uint8 [N, K / 32 * block bytes]): int8
    as Q8_0 (fp16 d, 32 int8), int4 as Q4_1 (fp16 d, fp16 m, 16 bytes: weights 0-15 in the low nibbles, 16-31 in
    the high ones). None where K is not a multiple of 32 (the formats' block) or the group is not whole blocks."""
    num_out, num_in = qw.num_out, qw.num_in
    if num_in % 32 or (qw.method == "int4" and qw.group_size % 32):
        return None
    num_blocks = num_in // 32
    if qw.method == "int8":
        d = qw.scales.to(torch.float16).numpy().view(np.uint8).reshape(num_out, 1, 2)
        blocks = np.empty((num_out, num_blocks, 34), dtype=np.uint8)
        blocks[:, :, 0:2] = d
        blocks[:, :, 2:] = qw.qweight.numpy().view(np.uint8).reshape(num_out, num_blocks, 32)
        return "Q8_0", blocks.reshape(num_out, -1)
    assert qw.mins is not None
    per_block = torch.arange(num_blocks) * 32 // qw.group_size  # the group of each block
    d = qw.scales[:, per_block].to(torch.float16).numpy().view(np.uint8).reshape(num_out, num_blocks, 2)
    m = qw.mins[:, per_block].to(torch.float16).numpy().view(np.uint8).reshape(num_out, num_blocks, 2)
    packed = qw.qweight.numpy().reshape(num_out, num_blocks, 16)  # byte j: weights 2j (low), 2j + 1 (high)
    q = np.stack((packed & 15, packed >> 4), axis=-1).reshape(num_out, num_blocks, 32)  # along K
    blocks = np.empty((num_out, num_blocks, 20), dtype=np.uint8)
    blocks[:, :, 0:2], blocks[:, :, 2:4] = d, m
    blocks[:, :, 4:] = q[..., :16] | (q[..., 16:] << 4)
    return "Q4_1", blocks.reshape(num_out, -1)


def _is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    if not name.endswith(".weight") or tensor.dim() != 2 or not tensor.is_floating_point():
        return False
    module = name.removesuffix(".weight")
    # an even input size: int4 packs two weights per byte (every model this engine runs has one)
    return tensor.shape[1] % 2 == 0 and (module == "lm_head" or module.rsplit(".", 1)[-1] in _PROJECTIONS)


def quantize_state_dict(
    state_dict: dict[str, torch.Tensor], spec: QuantizationSpec, tie_word_embeddings: bool
) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` with each projection's and the output head's `weight` replaced by its quantized
    tensors (`X.qweight`, `X.scales`, `X.mins`); with tied embeddings `lm_head.*` is quantized from the
    embedding, which itself stays. With int4 the output head is int8 (`HEAD_METHOD`)."""
    out: dict[str, torch.Tensor] = {}
    sources = dict(state_dict)
    if tie_word_embeddings:
        sources["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    for name, tensor in sources.items():
        if not _is_quantizable(name, tensor):
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        qw = quantize(tensor, QuantizationSpec(HEAD_METHOD[spec.method]) if module == "lm_head" else spec)
        out[f"{module}.qweight"], out[f"{module}.scales"] = qw.qweight, qw.scales
        if qw.mins is not None:
            out[f"{module}.mins"] = qw.mins
    return out


def split_quantized(
    state_dict: dict[str, torch.Tensor], group_size: int
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(the plain tensors, {module name: QuantizedWeight}) of a state dict from `quantize_state_dict`: int8 where
    `qweight` is int8, int4 in groups of `group_size` where it is uint8. Raises ValueError where the scales do
    not match that format (e.g. quantized with another group size)."""
    plain: dict[str, torch.Tensor] = {}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        suffix = next((s for s in QUANTIZED_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            plain[name] = tensor
        else:
            modules.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
    weights: dict[str, QuantizedWeight] = {}
    for module, parts in modules.items():
        qweight, scales, mins = parts.get(".qweight"), parts.get(".scales"), parts.get(".mins")
        if qweight is None or scales is None:
            raise ModelLoadError(f"{module}: a quantized weight needs qweight and scales")
        num_out = qweight.shape[0]
        if qweight.dtype == torch.int8:
            weight = QuantizedWeight("int8", qweight, scales, None, int(qweight.shape[1]))
            expected: tuple[int, ...] = (num_out,)
        else:
            num_in = 2 * int(qweight.shape[1])
            weight = QuantizedWeight("int4", qweight, scales, mins, num_in, group_size)
            expected = (num_out, -(-num_in // group_size))
        if tuple(scales.shape) != expected or (
            weight.method == "int4" and (mins is None or mins.shape != scales.shape)
        ):
            raise ModelLoadError(
                f"{module}: quantized scales {tuple(scales.shape)} do not fit {weight.method} with group size "
                f"{group_size} (expected {expected})"
            )
        weights[module] = weight
    return plain, weights
