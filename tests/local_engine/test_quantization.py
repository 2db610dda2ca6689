"""Weight-only quantization (`local_engine/quantization.py`): the formats' error bounds, every kernel against the
torch reference (dequantize, then `F.linear`), and the settings.

Tolerances, stated once: the native CPU kernel and the Triton kernel compute the same products as the reference in
float32, in another summation order: rtol/atol 1e-4 (outputs of magnitude ~10). With bfloat16 activations the
Triton kernel sums in float32 and rounds once: interpreted, within one bfloat16 ulp (rtol 2^-7) of the float32
product, and within 2e-2 of the reference (which rounds the weights to bfloat16 first); on a GPU (weights rounded
like the reference's) within 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from pydantic import ValidationError

from gateway.settings import Settings
from local_engine.config import EngineConfig
from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.linear import GEMM_MIN_ROWS, QuantizedLinear
from local_engine.quantization import (
    QuantizationSpec,
    QuantizedWeight,
    dequantize,
    quantize,
    quantize_state_dict,
    reference_linear,
    split_quantized,
    to_gguf_blocks,
)

needs_kernel = pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
SPECS = [
    QuantizationSpec("int8"),
    QuantizationSpec("int4", 32),
    QuantizationSpec("int4", 64),
    QuantizationSpec("int4", 128),
]
IDS = [spec.tag for spec in SPECS]


def weight_with_edge_rows(num_out: int, num_in: int, seed: int) -> torch.Tensor:
    """Random weights of a few scales, plus a zero row, a constant row and one large outlier."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(num_out, num_in, generator=generator) * torch.logspace(-3, 0, num_out)[:, None]
    w[0] = 0.0
    w[1] = 0.37
    w[2, 5] = 40.0
    return w


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize(("num_out", "num_in"), [(24, 576), (9, 96)])  # 576 = 4.5 groups of 128: a short last one
def test_round_trip_error_is_at_most_half_a_step(spec: QuantizationSpec, num_out: int, num_in: int) -> None:
    w = weight_with_edge_rows(num_out, num_in, seed=num_in)
    qw = quantize(w, spec)
    error = (dequantize(qw) - w).abs()
    if spec.method == "int8":
        assert qw.qweight.dtype == torch.int8 and qw.qweight.shape == (num_out, num_in) and qw.mins is None
        assert int(qw.qweight.abs().max()) <= 127
        step = qw.scales[:, None].expand_as(w)
        bound = 0.5 * step * (1 + 2**-10)  # half a step (the float16 scale may clamp the largest weight a hair)
    else:
        num_groups = -(-num_in // spec.group_size)
        assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (num_out, num_in // 2)
        assert qw.scales.shape == qw.mins.shape == (num_out, num_groups)
        groups = torch.arange(num_in) // spec.group_size
        step, low = qw.scales[:, groups], qw.mins[:, groups]
        bound = 0.5 * step * (1 + 2**-10) + low.abs() * 2**-10  # half a step, plus the float16 minimum's rounding
    assert bool((error <= bound + 1e-7).all()), float((error - bound).max())
    assert float(error[0].max()) == 0.0  # a zero row stays zero
    # the scales are float16 values, so Q8_0 / Q4_1 blocks hold them exactly
    assert torch.equal(qw.scales.half().float(), qw.scales)
    print(f"\n{spec.tag} [{num_out}x{num_in}]: max error {float(error.max()):.3g}, mean {float(error.mean()):.3g}")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_gguf_blocks_dequantize_to_the_same_weights(spec: QuantizationSpec) -> None:
    """The gguf package's own Q8_0 / Q4_1 dequantization of `to_gguf_blocks` equals ours exactly: the native
    kernel's block panels hold exactly the quantized weights."""
    qw = quantize(weight_with_edge_rows(20, 320, seed=3), spec)
    blocks = to_gguf_blocks(qw)
    assert blocks is not None
    kind, raw = blocks
    assert kind == ("Q8_0" if spec.method == "int8" else "Q4_1") and raw.dtype == np.uint8
    theirs = gguf_dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)
    assert np.array_equal(theirs, dequantize(qw).numpy())


def test_gguf_blocks_need_whole_blocks() -> None:
    assert to_gguf_blocks(quantize(torch.randn(4, 48), QuantizationSpec("int8"))) is None


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_block_panels_unpack_to_exactly_the_dequantized_weight(spec: QuantizationSpec) -> None:
    for num_out, num_in in ((150, 576), (7, 64), (1536, 128)):
        qw = quantize(weight_with_edge_rows(num_out, num_in, seed=num_out), spec)
        blocks = to_gguf_blocks(qw)
        if blocks is None:  # a group of 128 over K = 64: not whole blocks
            continue
        weight_format = cpu_kernels.BLOCK_FORMATS[blocks[0]]
        panels = cpu_kernels.pack_block_weight(blocks[1], weight_format, num_in)
        assert panels is not None
        unpacked = cpu_kernels.unpack_block_weight(panels, weight_format, num_out, num_in)
        assert unpacked is not None and torch.equal(unpacked, dequantize(qw))
        assert cpu_kernels.unpack_block_weight(panels, weight_format, num_out + 1000, num_in) is None  # wrong shape


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_cpu_kernel_equals_the_reference(spec: QuantizationSpec) -> None:
    generator = torch.Generator().manual_seed(11)
    w = torch.randn(150, 576, generator=generator) * 0.05
    qw = quantize(w, spec)
    bias = torch.randn(150, generator=generator)
    for use_kernels in (True, False):
        linear = QuantizedLinear(qw, has_bias=True, device=torch.device("cpu"), use_cpu_kernels=use_kernels)
        with torch.no_grad():
            linear.bias.copy_(bias)
        assert (linear.panels is not None) == use_kernels and (linear.quantized is None) == use_kernels
        # decode rows in registers, chunked, prefill sizes, and a chunk large enough for the GEMM on the weight
        for rows in (1, 3, 9, 96, 200, GEMM_MIN_ROWS + 5):
            x = torch.randn(rows, 580, generator=generator)[:, 4:]  # rows apart
            with torch.no_grad():
                got = linear(x)
            torch.testing.assert_close(got, reference_linear(x, qw, bias), rtol=1e-4, atol=1e-4)
    # resident: the panels alone (Q8_0 36, Q4_1 24 bytes per 32 weights and output; outputs padded to a panel)
    kernel = cpu_kernels.load()
    assert kernel is not None
    num_padded = -(-150 // kernel.panel_width) * kernel.panel_width
    packed = QuantizedLinear(qw, has_bias=False, device=torch.device("cpu"), use_cpu_kernels=True)
    assert packed.num_bytes == num_padded * 576 // 32 * (36 if spec.method == "int8" else 24)


def test_the_triton_kernel_equals_the_reference() -> None:
    pytest.importorskip("triton")
    from local_engine.kernels.quant_matmul import quant_matmul

    generator = torch.Generator().manual_seed(7)
    for spec in (QuantizationSpec("int8"), QuantizationSpec("int4", 32), QuantizationSpec("int4", 64)):
        qw = quantize(torch.randn(70, 160, generator=generator) * 0.1, spec)  # 160 = 2.5 groups of 64
        bias = torch.randn(70, generator=generator)
        for rows, dtype in ((1, torch.float32), (19, torch.float32), (5, torch.bfloat16)):
            x = (torch.randn(rows, 163, generator=generator)[:, 3:]).to(dtype)  # rows apart
            for b in (None, bias.to(dtype)):
                got = quant_matmul(x, qw.qweight, qw.scales, qw.mins, qw.num_in, qw.group_size, b)
                expected = reference_linear(x, qw, b)
                assert got.dtype == dtype and got.shape == (rows, 70)
                if dtype == torch.float32:
                    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
                else:  # interpreted: float32 weights and sums, rounded once to bfloat16: within one bf16 ulp
                    exact = torch.nn.functional.linear(x.float(), dequantize(qw), None if b is None else b.float())
                    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=2**-8)
                    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_compiled_triton_kernel_and_the_cuda_linear(spec: QuantizationSpec) -> None:
    from local_engine.kernels.quant_matmul import quant_matmul

    generator = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(300, 576, generator=generator) * 0.05, spec).to("cuda")
    linear = QuantizedLinear(qw, has_bias=False, device=torch.device("cuda"), use_cpu_kernels=False)
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 576, generator=generator).to("cuda", torch.bfloat16)
        expected = reference_linear(x, qw).float()
        got = quant_matmul(x, qw.qweight, qw.scales, qw.mins, qw.num_in, qw.group_size)
        torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2)
        with torch.no_grad():
            torch.testing.assert_close(linear(x).float(), expected, rtol=1e-2, atol=1e-2)


def test_split_refuses_scales_of_another_group_size() -> None:
    qw = quantize(torch.randn(8, 128), QuantizationSpec("int4", 32))
    state = {"x.qweight": qw.qweight, "x.scales": qw.scales, "x.mins": qw.mins, "x.bias": torch.zeros(8)}
    plain, weights = split_quantized(state, 32)
    assert set(plain) == {"x.bias"} and isinstance(weights["x"], QuantizedWeight)
    assert torch.equal(dequantize(weights["x"]), dequantize(qw))
    with pytest.raises(ValueError, match="group size 64"):
        split_quantized(state, 64)


@pytest.mark.parametrize("tied", [False, True])
def test_int4_keeps_the_output_head_in_int8(tied: bool) -> None:
    """An int4 output head cost +6.0% perplexity on the bundled model, int8 +0.02% (`HEAD_METHOD`); the
    projections are int4 in groups, the (tied) embedding stays float."""
    generator = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=generator),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 128, generator=generator),
    }
    if not tied:
        state["lm_head.weight"] = torch.randn(300, 64, generator=generator)
    out = quantize_state_dict(state, QuantizationSpec("int4", 32), tie_word_embeddings=tied)
    assert torch.equal(out["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    plain, weights = split_quantized(out, 32)
    assert set(plain) == {"model.embed_tokens.weight"}
    assert weights["model.layers.0.mlp.down_proj"].method == "int4" and weights["lm_head"].method == "int8"
    head = state["lm_head.weight"] if not tied else state["model.embed_tokens.weight"]
    assert torch.equal(dequantize(weights["lm_head"]), dequantize(quantize(head, QuantizationSpec("int8"))))


def test_settings_validate_the_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (EngineConfig().quantization, EngineConfig().quantization_group_size) == ("none", 32)
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(quantization="int3")  # type: ignore[arg-type]
    for bad in (0, 48, -32):
        with pytest.raises(ValidationError, match="multiple of 32"):
            EngineConfig(quantization="int4", quantization_group_size=bad)
    monkeypatch.setenv("UNIGATE_ENGINE__QUANTIZATION", "int4")
    monkeypatch.setenv("UNIGATE_ENGINE__QUANTIZATION_GROUP_SIZE", "64")
    engine = Settings(_env_file=None).engine.engine_config()  # type: ignore[call-arg]
    assert (engine.quantization, engine.quantization_group_size) == ("int4", 64)
    monkeypatch.setenv("UNIGATE_ENGINE__QUANTIZATION", "fp8")
    with pytest.raises(ValidationError, match="quantization"):
        Settings(_env_file=None)  # type: ignore[call-arg]
