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
libraries' small-M paths reach about half the read bandwidth, and a few dozen rows, where they reach about half
the FMA units' rate. With the native CPU kernels on, a `PackedLinear` also keeps the weight in the native
kernel's panels (`cpu_kernels.pack_linear_weight`) and sends calls of up to `NATIVE_MAX_ROWS` rows to
`cpu_kernels.linear`, which overlaps the weight's stream with the arithmetic. Measured on the same 30 layers,
weights cold, in ms, on an Intel Xeon (Ice Lake, AVX-512, 2 threads; best of 3, `benchmarks/cpu_linear.py`):

    rows                1      8     16     32     64     96    128    256
    oneDNN packed    33.5   34.4   38.4   54.1   81.1  103.5  142.1  244.4
    cpu_kernels      23.0   25.5   27.6   34.3   56.0   88.5  126.5  223.4
    F.linear (MKL)   19.9   56.1   91.9  102.8   85.0  124.8  147.2  308.3

(the kernel at 32 rows: 198 GFLOP/s, oneDNN 126; from 128 rows on, where prefill chunks' GEMMs are compute-bound,
the lead shrinks and changes hands from run to run on this noisy machine).

The panels cost the projections' bytes a second time (the oneDNN copy replaces the parameter); the engine counts
them in its weights memory.

A weight-only quantized projection (`EngineConfig.quantization`, `local_engine/quantization.py`) is a
`QuantizedLinear`: on CPU only its block panels (the GGUF formats above), read by the native kernel, except that a
call of `GEMM_MIN_ROWS` rows or more dequantizes the whole weight for that call alone and runs oneDNN's GEMM on it;
on a GPU the Triton dequantizing matmul; no float copy kept (`attach_quantized_linears` swaps it in before the
model's weights are allocated).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from local_engine import quantization
from local_engine.errors import ModelLoadError
from local_engine.kernels import cpu as cpu_kernels
from local_engine.quantization import QuantizedWeight

__all__ = [
    "NATIVE_MAX_ROWS",
    "PackedLinear",
    "QuantizedLinear",
    "attach_block_panels",
    "attach_quantized_linears",
    "can_pack",
    "is_packing_available",
    "pack_linears",
]

# Up to this many rows a call goes to the native kernel (it leads oneDNN by 15-37% up to 96 rows; from 128 rows
# on, where a prefill chunk's GEMM is compute-bound, neither leads everywhere and oneDNN keeps them).
NATIVE_MAX_ROWS = 96
# From this many rows on, a quantized projection (`QuantizedLinear`) dequantizes its whole weight for the call and
# runs oneDNN's GEMM on it: at a prefill chunk's 2,048 rows that is 1.1-1.5x faster than dequantizing inside the
# native kernel, whose float32 micro-kernel trails oneDNN's once the GEMM is compute-bound.
GEMM_MIN_ROWS = 1024


def is_packing_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
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

    With `native_max_rows` > 0 the weight is also kept packed in the native kernel's panels, and 2-D inputs of at
    most that many rows go to `cpu_kernels.linear` (float32; anything it does not take stays on oneDNN)."""

    def __init__(self, linear: nn.Linear, native_max_rows: int = 0, shared: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.num_bytes = weight.numel() * weight.element_size()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        # (`nn.Linear.bias` is typed as always present; it is None for a projection without one)
        self.bias: torch.Tensor | None = None if linear.bias is None else linear.bias.detach()
        self.native_max_rows = native_max_rows if weight.dtype == torch.float32 else 0
        self.panels = cpu_kernels.pack_linear_weight(weight) if self.native_max_rows else None
        self.weight_format = cpu_kernels.WEIGHTS_F32  # of `panels`; a GGUF's blocks after `attach_block_panels`
        # Bytes beyond the model's parameters: the oneDNN copy replaces the parameter, unless that lives on in an
        # embedding (a `shared` weight); the native kernel's panels are one more copy.
        panel_bytes = 0 if self.panels is None else self.panels.numel() * self.panels.element_size()
        self.extra_bytes = panel_bytes + (self.num_bytes if shared else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dim() == 2 and x.shape[0] <= self.native_max_rows:
            native = cpu_kernels.linear(x, self.panels, self.out_features, self.bias, self.weight_format)
            if native is not None:
                return native
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, native_max_rows: int = 0) -> int:
    """Swap every `nn.Linear` in `model` (CPU, float32 or bfloat16: see `can_pack`) for a `PackedLinear`, each
    keeping the native kernel's panels too for calls of up to `native_max_rows` rows (0: never); returns how many
    projections are now packed, counting quantized ones already in the native kernel's panels (`QuantizedLinear`).
    Tied weights stay shared where they are still used elsewhere (an embedding keeps its own tensor)."""
    swapped = sum(1 for m in model.modules() if isinstance(m, QuantizedLinear) and m.panels is not None)
    elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" and can_pack(child.weight.dtype):
                shared = id(child.weight) in elsewhere
                setattr(parent, name, PackedLinear(child, native_max_rows, shared))
                swapped += 1
    return swapped


def attach_block_panels(
    model: nn.Module,
    blocks: Mapping[str, tuple[str, np.ndarray]],
    packed_modules: Mapping[str, tuple[str, int]],
    tied_embeddings: bool = False,
) -> dict[str, int]:
    """Give each `PackedLinear` of `model` with native panels whose checkpoint weights all come as GGUF blocks of
    one type (`loader.Checkpoint.blocks`: Q4_1 or Q8_0, by HF name) panels of those blocks instead of float32
    (`cpu_kernels.pack_block_weight`): decode-size calls then stream the checkpoint's own bytes and dequantize
    them on the fly (in registers for a few rows, a chunk at a time in L1 beyond) to the very float32 weights the
    other paths use, so their results are unchanged, bit for bit. A fused projection (`packed_modules`:
    checkpoint fragment -> (fused module fragment, shard index)) needs every shard in the same type; with
    `tied_embeddings`, `lm_head` takes the embedding's blocks. Returns {type name: projections}."""
    shards: dict[str, list[str]] = {}
    for fragment, (fused, _) in sorted(packed_modules.items(), key=lambda item: item[1][1]):
        shards.setdefault(fused, []).append(fragment)
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        if not isinstance(module, PackedLinear) or isinstance(module, QuantizedLinear) or module.panels is None:
            continue
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        sources = [f"{prefix}{fragment}.weight" for fragment in shards.get(leaf, [leaf])]
        if name == "lm_head" and tied_embeddings:
            sources = ["model.embed_tokens.weight"]
        found = [blocks.get(source) for source in sources]
        kinds = {entry[0] for entry in found if entry is not None}
        if None in found or len(kinds) != 1 or (kind := kinds.pop()) not in cpu_kernels.BLOCK_FORMATS:
            continue
        weight_format = cpu_kernels.BLOCK_FORMATS[kind]
        raw = np.concatenate([entry[1] for entry in found if entry is not None])
        panels = cpu_kernels.pack_block_weight(raw, weight_format, module.in_features)
        if panels is None or raw.shape[0] != module.out_features:
            continue
        module.extra_bytes += panels.numel() - module.panels.numel() * module.panels.element_size()
        module.panels, module.weight_format = panels, weight_format
        counts[kind] = counts.get(kind, 0) + 1
    return counts


class QuantizedLinear(PackedLinear):
    """A projection on weight-only quantized weights (`local_engine/quantization.py`), never a float copy of them:

    - CPU with the native kernels (float32 activations): the weight lives only in the native kernel's block panels
      (int8 as Q8_0, int4 as Q4_1: `quantization.to_gguf_blocks`), and a call goes to `cpu_kernels.linear`, which
      dequantizes a chunk at a time in L1; a call of at least `GEMM_MIN_ROWS` rows (a large prefill chunk) instead
      unpacks the float weight for itself (`cpu_kernels.unpack_block_weight`) and runs oneDNN (`_gemm`). As a
      `PackedLinear` with panels, the fused native decode step (`cpu_decode.py`) takes it like a GGUF file's blocks.
    - CUDA: the Triton dequantizing matmul (`kernels/quant_matmul.py`, w8a16 / w4a16).
    - Otherwise: the torch reference, dequantizing this one weight to x's dtype per call, then `F.linear`.

    `bias` is a parameter (the model's dtype, loaded by `load_weights` like any other); the quantized tensors are
    plain attributes, so `.to()`, `to_empty()` and `state_dict()` leave them alone."""

    def __init__(self, weight: QuantizedWeight, has_bias: bool, device: torch.device, use_cpu_kernels: bool) -> None:
        nn.Module.__init__(self)
        self.in_features = weight.num_in
        self.out_features = weight.num_out
        self.method = weight.method
        self.bias = nn.Parameter(torch.empty(weight.num_out), requires_grad=False) if has_bias else None
        self.packed_weight = None
        self.panels: torch.Tensor | None = None
        self.weight_format = cpu_kernels.WEIGHTS_F32
        self.native_max_rows = 0
        self.quantized: QuantizedWeight | None = None
        blocks = quantization.to_gguf_blocks(weight) if device.type == "cpu" and use_cpu_kernels else None
        if blocks is not None:
            weight_format = cpu_kernels.BLOCK_FORMATS[blocks[0]]
            self.panels = cpu_kernels.pack_block_weight(blocks[1], weight_format, weight.num_in)
            if self.panels is not None:
                self.weight_format, self.native_max_rows = weight_format, NATIVE_MAX_ROWS
        if self.panels is None:
            self.quantized = weight.to(device)
        self.num_bytes = self.panels.numel() if self.panels is not None else weight.num_bytes  # uint8 panels
        self.extra_bytes = self.num_bytes  # none of it is a parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if self.panels is not None:
            rows = x.reshape(-1, self.in_features)
            if rows.dtype != torch.float32 or rows.stride(1) != 1:
                rows = rows.to(torch.float32).contiguous()
            if rows.shape[0] >= GEMM_MIN_ROWS and is_packing_available():
                out = self._gemm(rows)
                if out is not None:
                    return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            out = cpu_kernels.linear(rows, self.panels, self.out_features, bias, self.weight_format)
            assert out is not None, "the native kernel refused a projection it packed"
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        weight = self.quantized
        assert weight is not None
        if x.device.type == "cuda":
            from local_engine.kernels.quant_matmul import quant_matmul

            rows = x.reshape(-1, self.in_features)
            out = quant_matmul(rows, weight.qweight, weight.scales, weight.mins, weight.num_in, weight.group_size, bias)
            return out.view(*x.shape[:-1], self.out_features)
        return quantization.reference_linear(x, weight, bias)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A call of many rows (a prefill chunk): the float weight, dequantized from the panels for this call only
        and dropped after it, handed to oneDNN as a plain row-major weight (laying it out in oneDNN's packed format
        first, as `PackedLinear` does once, cost 0.4-0.6 ms more per call than oneDNN's own handling of a plain
        weight: the packed format pays off only when a weight is reused). The weight is the panels' values exactly;
        only the order of the sums differs from the native kernel's."""
        assert self.panels is not None
        weight = cpu_kernels.unpack_block_weight(self.panels, self.weight_format, self.out_features, self.in_features)
        if weight is None:
            return None
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, weight, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        where = "cpu panels" if self.quantized is None else str(self.quantized.qweight.device)
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}, {where}"


def attach_quantized_linears(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    packed_modules: Mapping[str, tuple[str, int]],
    device: torch.device,
    group_size: int,
    use_cpu_kernels: bool,
) -> dict[str, torch.Tensor]:
    """Swap each `nn.Linear` of `model` whose checkpoint weights come quantized (`quantization.quantize_state_dict`
    names: `X.qweight`, `X.scales`, `X.mins`; int4 in groups of `group_size`) for a `QuantizedLinear` on `device`
    (with `use_cpu_kernels`, on CPU: in the native kernel's block panels), the shards of a fused
    projection (`packed_modules`: checkpoint fragment -> (fused module fragment, shard index)) stacked in order.
    Call it on the model still on the meta device, before `to_empty`: a quantized projection never gets a float
    weight. Returns the rest of the state dict (for `load_weights`; biases included)."""
    plain, weights = quantization.split_quantized(state_dict, group_size)
    if not weights:
        return state_dict
    fused: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    for name, weight in weights.items():
        parent, _, leaf = name.rpartition(".")
        target, shard = packed_modules.get(leaf, (leaf, 0))
        fused.setdefault(f"{parent}.{target}" if parent else target, []).append((shard, weight))
    modules = dict(model.named_modules())
    for name, shards in fused.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"quantized checkpoint tensors for {name!r}, which is not a projection of this model")
        weight = QuantizedWeight.cat([w for _, w in sorted(shards, key=lambda item: item[0])])
        if (weight.num_out, weight.num_in) != (linear.out_features, linear.in_features):
            raise ModelLoadError(
                f"{name}: quantized checkpoint shape {(weight.num_out, weight.num_in)} != model "
                f"{(linear.out_features, linear.in_features)}"
            )
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, QuantizedLinear(weight, linear.bias is not None, device, use_cpu_kernels))
    return plain
