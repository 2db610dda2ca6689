"""Pre-quantized Hugging Face checkpoints: 4-bit GPTQ, AWQ and auto-round weights read into the engine's int4 format.

A checkpoint whose `config.json` has a `quantization_config` stores each quantized projection as packed integers:

    GPTQ (`quant_method: gptq`)   qweight int32 [K/8, N]: 8 inputs of one output per word, input k in bits 4(k%8)
                                  qzeros int32 [G, N/8]: 8 outputs' zero points per word; stored minus one (the
                                  original AutoGPTQ format) unless `checkpoint_format: gptq_v2`
                                  scales float16 [G, N]; g_idx int32 [K] (each input's group)
    AWQ (`quant_method: awq`,     qweight int32 [K, N/8], qzeros int32 [G, N/8]: 8 outputs per word in the order
    `version: gemm`)              0, 2, 4, 6, 1, 3, 5, 7; zero points as they are; scales float16 [G, N]
    auto-round (`quant_method:    `packing_format` names one of the two: `auto_round:auto_gptq` (GPTQ, zero points
    auto-round`)                  minus one), `auto_round` / `auto_round:gptqmodel` (GPTQ, as they are),
                                  `auto_round:auto_awq` (AWQ)

and the weight is `scale * (q - zero)` per group of `group_size` inputs. That is the engine's int4 (`quantization.
py`: `scale * q + min`) with `min = -scale * zero`, so `convert` rewrites the tensors into `X.qweight`, `X.scales`,
`X.mins` and the rest of the engine (the CPU kernels' Q4_1 panels, the Triton dequantizing matmul, the torch
reference) serves them unchanged. `min` is held as a float16 value like every int4 minimum here: exact for
symmetric checkpoints (zero 8: a power of two times the float16 scale), within one float16 rounding of
`scale * zero` otherwise (at most 2^-11 of it). A group size of -1 (one group per row) becomes groups of 32
with the row's scale and zero repeated.

Refused with a message naming the field (`CheckpointError`, code `checkpoint_unsupported`): other bit widths,
act-order GPTQ (`desc_act` with a g_idx that is not the inputs' groups in order), AWQ's other kernels (`gemv`,
`marlin`) or no zero point, group sizes that are not a multiple of 32, other quantization methods. The layouts
were checked against auto-round 0.16.1's own decoders on checkpoints it wrote
(`tests/local_engine/loading/prequantized/`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from local_engine.errors import CheckpointError
from local_engine.quantization import fp16_exact

__all__ = ["PackedFormat", "convert", "packed_format"]

BITS = 4
_PER_WORD = 32 // BITS
_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)
# AWQ's word holds outputs 0, 2, 4, 6, 1, 3, 5, 7 of its 8 in nibbles 0..7: output j sits in nibble _AWQ_NIBBLE[j].
_AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
_IN_ORDER = list(range(_PER_WORD))
_GPTQ_OFFSET_PACKINGS = {"auto_round:auto_gptq": 1, "auto_round": 0, "auto_round:gptqmodel": 0}


@dataclass(frozen=True)
class PackedFormat:
    """How one checkpoint packs its weights."""

    method: str  # the checkpoint's quant_method: gptq, awq or auto-round
    layout: str  # "gptq" | "awq"
    group_size: int  # -1: one group per row
    zero_offset: int  # added to each stored zero point

    @property
    def tag(self) -> str:
        return f"{self.method} int4 g{self.group_size}"


def packed_format(config: Mapping[str, Any], source: Path | str) -> PackedFormat | None:
    """The packing `config.json`'s `quantization_config` describes; None without one. Raises CheckpointError
    (`checkpoint_unsupported`) for what the engine cannot serve as it is."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise _unsupported(source, f"quantization_config must be an object, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower()
    if method in ("auto-round", "intel/auto-round", "auto_round"):
        method = "auto-round"
        packing = str(qc.get("packing_format", "auto_round:auto_gptq"))
        if packing == "auto_round:auto_awq":
            layout, offset = "awq", 0
        elif packing in _GPTQ_OFFSET_PACKINGS:
            layout, offset = "gptq", _GPTQ_OFFSET_PACKINGS[packing]
        else:
            raise _unsupported(source, f"auto-round packing_format {packing!r} (served: {_served_packings()})")
        if str(qc.get("data_type", "int")) != "int":
            raise _unsupported(source, f"auto-round data_type {qc.get('data_type')!r} (served: int)")
    elif method == "gptq":
        layout, offset = "gptq", 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    elif method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _unsupported(source, f"AWQ version {version!r} (served: gemm)")
        if qc.get("zero_point", True) is False:
            raise _unsupported(source, "AWQ without zero points (zero_point: false)")
        layout, offset = "awq", 0
    else:
        raise _unsupported(
            source,
            f"quant_method {qc.get('quant_method')!r} (served: 4-bit gptq, awq and auto-round; or load the float "
            "checkpoint with UNIGATE_ENGINE__QUANTIZATION=int8|int4)",
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != BITS:
        raise _unsupported(source, f"{method} with bits={bits!r} (served: 4)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise _unsupported(source, f"{method} group_size {group!r} (served: -1 or a multiple of 32)")
    return PackedFormat(method, layout, group, offset)


def convert(
    state_dict: Mapping[str, torch.Tensor], fmt: PackedFormat, source: Path | str
) -> tuple[dict[str, torch.Tensor], int]:
    """(the state dict with every packed projection as the engine's int4 tensors, their group size)."""
    out: dict[str, torch.Tensor] = {}
    modules = sorted(name.removesuffix(".qweight") for name in state_dict if name.endswith(".qweight"))
    if not modules:
        raise CheckpointError(
            f"{source}: config.json has a {fmt.method} quantization_config but no tensor is named *.qweight; the "
            "checkpoint is incomplete.",
            code="checkpoint_corrupt",
        )
    packed = {f"{m}.{part}" for m in modules for part in ("qweight", "qzeros", "scales", "g_idx")}
    out.update({name: t for name, t in state_dict.items() if name not in packed})
    group_size = 32 if fmt.group_size == -1 else fmt.group_size  # the checkpoint's, which the engine's int4 takes
    for module in modules:
        qweight, scales, mins = _convert_one(state_dict, module, fmt, group_size, source)
        out[f"{module}.qweight"], out[f"{module}.scales"], out[f"{module}.mins"] = qweight, scales, mins
    return out, group_size


def _convert_one(
    state_dict: Mapping[str, torch.Tensor], module: str, fmt: PackedFormat, group_size: int, source: Path | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    parts = {p: state_dict.get(f"{module}.{p}") for p in ("qweight", "qzeros", "scales")}
    missing = [p for p, t in parts.items() if t is None]
    if missing:
        raise _corrupt(source, f"{module} has qweight but no {', '.join(missing)}")
    qweight, qzeros, scales = (parts[p] for p in ("qweight", "qzeros", "scales"))
    assert qweight is not None and qzeros is not None and scales is not None
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or scales.dim() != 2:
        raise _corrupt(source, f"{module}: qweight and qzeros must be 2-D int32 ({qweight.dtype}, {qzeros.dtype})")
    if fmt.layout == "gptq":
        num_in, num_out = qweight.shape[0] * _PER_WORD, qweight.shape[1]
        q = _unpack_rows(qweight)  # [K, N]
    else:
        num_in, num_out = qweight.shape[0], qweight.shape[1] * _PER_WORD
        q = _unpack_columns(qweight, _AWQ_NIBBLE)
    z = _unpack_columns(qzeros, _AWQ_NIBBLE if fmt.layout == "awq" else _IN_ORDER)  # [G, N]
    z = z.to(torch.float32) + fmt.zero_offset
    checkpoint_group = num_in if fmt.group_size == -1 else fmt.group_size
    num_groups = -(-num_in // checkpoint_group)
    if tuple(scales.shape) != (num_groups, num_out) or tuple(z.shape) != (num_groups, num_out):
        raise _corrupt(
            source,
            f"{module}: scales {tuple(scales.shape)} and zero points {tuple(z.shape)} do not fit a [{num_out}, "
            f"{num_in}] weight in groups of {checkpoint_group} (expected ({num_groups}, {num_out}))",
        )
    if num_in % 32:
        raise _unsupported(source, f"{module} has {num_in} inputs, not a multiple of 32")
    g_idx = state_dict.get(f"{module}.g_idx")
    in_order = torch.arange(num_in, dtype=torch.int32) // checkpoint_group
    if g_idx is not None and not torch.equal(g_idx.to(torch.int32), in_order):
        raise _unsupported(source, f"{module}: act-order GPTQ (desc_act: its g_idx is not the inputs' groups in order)")
    s = scales.to(torch.float32)
    if fmt.group_size == -1:  # one group per row: the engine's groups of 32, each with the row's scale and zero
        s, z = s.expand(num_in // group_size, -1), z.expand(num_in // group_size, -1)
    qt = q.t().to(torch.uint8)  # [N, K], 0..15
    packed = (qt[:, 0::2] | (qt[:, 1::2] << 4)).contiguous()
    scales_out = fp16_exact(s.t().contiguous())
    return packed, scales_out, fp16_exact(-(s * z).t().contiguous())


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 values along the rows each -> [8R, C]."""
    nibbles = (words[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(words.shape[0] * _PER_WORD, words.shape[1])


def _unpack_columns(words: torch.Tensor, nibble_of: list[int] = _IN_ORDER) -> torch.Tensor:
    """int32 [R, C] holding 8 values along the columns each, value j in nibble `nibble_of[j]` -> [R, 8C]."""
    nibbles = (words[:, :, None] >> _SHIFTS[None, None, :]) & 0xF
    return nibbles[:, :, nibble_of].reshape(words.shape[0], words.shape[1] * _PER_WORD)


def _served_packings() -> str:
    return ", ".join([*sorted(_GPTQ_OFFSET_PACKINGS), "auto_round:auto_awq"])


def _unsupported(source: Path | str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: {what} is not served by the local engine; serve the checkpoint with vLLM as a `type: openai` "
        "upstream, or load its float weights with UNIGATE_ENGINE__QUANTIZATION=int4.",
        code="checkpoint_unsupported",
    )


def _corrupt(source: Path | str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: {what}; the checkpoint is incomplete.", code="checkpoint_corrupt")
