"""Pre-quantized checkpoints (`local_engine/prequantized.py`): 4-bit GPTQ, AWQ and auto-round directories written by
auto-round 0.16.1 from a tiny random Llama (`prequantized/make_fixtures.py`, which also wrote each one's
`NAME.reference.safetensors`: the float32 weights auto-round's own decoders read from the packed tensors).

Bounds: the engine's int4 weights equal the reference exactly for the symmetric checkpoints (zero point 8: the
minimum -8 * scale is a float16 value) and within one float16 rounding of the minimum (2^-11 of scale * zero) for
AWQ's asymmetric one; the engine on the checkpoint equals a float32 engine on its dequantized weights within 1e-4
and greedy token for token, and one on auto-round's within 1e-4 (symmetric) or 1e-3 (AWQ).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from local_engine import prequantized, quantization
from local_engine.errors import CheckpointError
from local_engine.layers.linear import QuantizedLinear
from local_engine.loader import Checkpoint, load_checkpoint

from .test_quantized_loading import GREEDY, PROMPTS, dequantized, engine_of, prefill_logits

FIXTURES = Path(__file__).parent / "prequantized"
# fixture: (quant_method, group size the engine serves)
CASES = {"gptq-w4g32": ("gptq", 32), "awq-w4g64": ("awq", 64), "autoround-w4g32": ("auto-round", 32)}


def reference_checkpoint(checkpoint: Checkpoint, reference: dict[str, torch.Tensor]) -> Checkpoint:
    """The checkpoint with each quantized projection as auto-round's float32 decoding of it."""
    group_size = checkpoint.hf_config["unigate_quantization"]["group_size"]
    plain, _ = quantization.split_quantized(checkpoint.state_dict, group_size)
    config = {k: v for k, v in checkpoint.hf_config.items() if k != "unigate_quantization"}
    return Checkpoint(config, {**plain, **reference}, checkpoint.tokenizer, checkpoint.source, 0.0, False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_prequantized_checkpoint_reads_the_weights_its_quantizer_wrote(name: str) -> None:
    method, group_size = CASES[name]
    checkpoint = load_checkpoint(FIXTURES / name)
    declared = checkpoint.hf_config["unigate_quantization"]
    assert declared == {"method": "int4", "group_size": group_size, "checkpoint": f"{method} int4 g{group_size}"}
    reference = load_file(str(FIXTURES / f"{name}.reference.safetensors"))
    _, weights = quantization.split_quantized(checkpoint.state_dict, group_size)
    assert sorted(f"{m}.weight" for m in weights) == sorted(reference)  # lm_head stayed float, as written
    assert "lm_head.weight" in checkpoint.state_dict
    for key, expected in reference.items():
        weight = weights[key.removesuffix(".weight")]
        got = quantization.dequantize(weight)
        if method == "awq":  # asymmetric: min = -scale * zero rounded to float16
            groups = torch.arange(weight.num_in) // group_size
            bound = (weight.scales.abs() * 16)[:, groups] * 2.0**-11
            assert ((got - expected).abs() <= bound).all(), key
        else:
            assert torch.equal(got, expected), key


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_engine_serves_a_prequantized_checkpoint_as_its_reference(name: str) -> None:
    checkpoint = load_checkpoint(FIXTURES / name)
    engine = engine_of(checkpoint)  # no quantization setting: the checkpoint's own
    linears = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * 2 and {m.method for m in linears} == {"int4"}  # lm_head stays float
    assert engine.stats()["quantization"] == "int4"
    # the serving paths against the same math in float32 (the int4 weights dequantized): 1e-4, greedy identical
    ours = engine_of(dequantized(checkpoint, CASES[name][1]))
    assert not any(isinstance(m, QuantizedLinear) for m in ours.runner.model.modules())
    logits = prefill_logits(engine)
    torch.testing.assert_close(logits, prefill_logits(ours), rtol=1e-4, atol=1e-4)
    tokens = [c[0].token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert tokens == [c[0].token_ids for c in ours.generate(PROMPTS, GREEDY)]
    torch_path = engine_of(checkpoint, cpu_kernels=False)  # the torch reference path, dequantizing per call
    torch.testing.assert_close(prefill_logits(torch_path), logits, rtol=1e-4, atol=1e-4)
    # and against auto-round's decoding: the same weights (symmetric), or within AWQ's float16 minimums
    theirs = engine_of(reference_checkpoint(checkpoint, load_file(str(FIXTURES / f"{name}.reference.safetensors"))))
    tolerance = 1e-3 if CASES[name][0] == "awq" else 1e-4
    torch.testing.assert_close(logits, prefill_logits(theirs), rtol=tolerance, atol=tolerance)


def with_config(tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of a fixture with its quantization_config changed (None removes a key)."""
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    config = json.loads((target / "config.json").read_text())
    qc = config["quantization_config"]
    for key, value in changes.items():
        if value is None:
            qc.pop(key, None)
        else:
            qc[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("gptq-w4g32", {"bits": 8}, "bits=8"),
        ("gptq-w4g32", {"group_size": 16}, "group_size 16"),
        ("awq-w4g64", {"version": "gemv"}, "AWQ version 'gemv'"),
        ("awq-w4g64", {"zero_point": False}, "zero_point: false"),
        ("autoround-w4g32", {"packing_format": "auto_round:fp8"}, "packing_format 'auto_round:fp8'"),
        ("gptq-w4g32", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ],
)
def test_what_the_engine_cannot_serve_is_refused_by_name(
    tmp_path: Path, name: str, changes: dict[str, object], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message) as caught:
        load_checkpoint(with_config(tmp_path, name, **changes))
    assert caught.value.code == "checkpoint_unsupported"


def test_act_order_and_damaged_tensors_are_refused(tmp_path: Path) -> None:
    source = with_config(tmp_path, "gptq-w4g32", desc_act=True)
    tensors = load_file(str(source / "model.safetensors"))
    g_idx = tensors["model.layers.0.mlp.up_proj.g_idx"]
    tensors["model.layers.0.mlp.up_proj.g_idx"] = g_idx.flip(0).contiguous()  # groups out of order: act-order
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(CheckpointError, match="act-order") as caught:
        load_checkpoint(source)
    assert caught.value.code == "checkpoint_unsupported"

    tensors["model.layers.0.mlp.up_proj.g_idx"] = g_idx
    del tensors["model.layers.1.self_attn.k_proj.qzeros"]
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(CheckpointError, match="k_proj has qweight but no qzeros") as caught:
        load_checkpoint(source)
    assert caught.value.code == "checkpoint_corrupt"


def test_quantizing_a_quantized_checkpoint_again_is_refused() -> None:
    with pytest.raises(CheckpointError, match=r"already quantized \(gptq int4 g32\).*QUANTIZATION=none") as caught:
        load_checkpoint(FIXTURES / "gptq-w4g32", quantization="int8")
    assert caught.value.code == "checkpoint_unsupported"


def pack_words(values: np.ndarray, axis: int, order: list[int]) -> torch.Tensor:
    """8 4-bit values per int32 along `axis`, value `order[i]` of each 8 in nibble i (the layouts as documented)."""
    moved = np.moveaxis(values.astype(np.uint32), axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, 8)[..., order]
    words = (grouped << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32))


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(["gptq", "awq"]),
    num_in=st.sampled_from([32, 64, 96, 256]),
    num_out=st.sampled_from([8, 16, 40]),
    group=st.sampled_from([32, 64, 128, -1]),
    offset=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_packed_weight_reads_back_as_scale_times_q_minus_zero(
    layout: str, num_in: int, num_out: int, group: int, offset: int, seed: int
) -> None:
    """A reference packer written from the format descriptions (GPTQ: inputs along the rows of qweight, outputs
    along qzeros' words in order; AWQ: outputs along both in the order 0, 2, 4, 6, 1, 3, 5, 7) against `convert`, on
    random shapes, group sizes (a short last group included), zero-point conventions and values; the engine's
    weight is `scale * (q - zero)` within the float16 rounding of its minimum."""
    if group > num_in or (layout == "awq" and offset):
        return
    rng = np.random.default_rng(seed)
    checkpoint_group = num_in if group == -1 else group
    num_groups = -(-num_in // checkpoint_group)
    q = rng.integers(0, 16, (num_in, num_out))
    zeros = rng.integers(offset, 16, (num_groups, num_out))  # stored as zero - offset, in 0..15
    scales = torch.from_numpy(rng.uniform(-0.1, 0.1, (num_groups, num_out))).to(torch.float16)
    in_order, awq_order = list(range(8)), [0, 2, 4, 6, 1, 3, 5, 7]
    if layout == "gptq":
        qweight, qzeros = pack_words(q, 0, in_order), pack_words(zeros - offset, 1, in_order)
    else:
        qweight, qzeros = pack_words(q, 1, awq_order), pack_words(zeros - offset, 1, awq_order)
    fmt = prequantized.PackedFormat(layout, layout, group, offset)
    state, group_size = prequantized.convert({"p.qweight": qweight, "p.qzeros": qzeros, "p.scales": scales}, fmt, "x")
    _, weights = quantization.split_quantized(state, group_size)
    groups = torch.arange(num_in) // checkpoint_group
    expected = (scales.float()[groups] * torch.from_numpy(q - zeros[groups.numpy()]).float()).t()
    bound = (scales.float().abs().amax() * 16 * 2**-11).item()
    torch.testing.assert_close(quantization.dequantize(weights["p"]), expected, rtol=0, atol=bound)


def test_one_group_per_row_becomes_groups_of_32_with_the_rows_scale() -> None:
    """group_size -1 (per-channel GPTQ): checked on a weight packed here by the layout the fixtures verified."""
    torch.manual_seed(0)
    num_out, num_in = 16, 64
    q = torch.randint(0, 16, (num_in, num_out), dtype=torch.int32)
    zeros = torch.randint(1, 16, (1, num_out), dtype=torch.int32)
    scales = (torch.rand(1, num_out) / 10).to(torch.float16)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    qweight = (q.view(num_in // 8, 8, num_out) << shifts[None, :, None]).sum(1, dtype=torch.int32)
    qzeros = ((zeros - 1).view(1, num_out // 8, 8) << shifts).sum(2, dtype=torch.int32)  # stored minus one
    fmt = prequantized.PackedFormat("gptq", "gptq", -1, 1)
    state, group_size = prequantized.convert({"p.qweight": qweight, "p.qzeros": qzeros, "p.scales": scales}, fmt, "x")
    assert group_size == 32
    _, weights = quantization.split_quantized(state, group_size)
    expected = (scales.float() * (q - zeros).float()).t()
    bound = float(scales.max()) * 2**-7  # 16 * scale * 2^-11: the float16 minimums
    torch.testing.assert_close(quantization.dequantize(weights["p"]), expected, rtol=0, atol=bound)


def test_the_zero_point_convention_follows_the_checkpoint_format() -> None:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert prequantized.packed_format({"quantization_config": base}, "x") == prequantized.PackedFormat(
        "gptq", "gptq", 128, 1
    )
    v2 = {"quantization_config": {**base, "checkpoint_format": "gptq_v2"}}
    assert prequantized.packed_format(v2, "x") == prequantized.PackedFormat("gptq", "gptq", 128, 0)
    assert prequantized.packed_format({"model_type": "llama"}, "x") is None


def test_a_local_deployment_serves_a_prequantized_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The path a `type: local` deployment takes (`backends.local.load_engine`), with the quality check on: there
    is no float checkpoint to compare with, so it says so instead of comparing the weights with themselves."""
    from backends.config import LocalEngineOptions
    from backends.local import LocalBackendConfig, load_engine

    options = {"device": "cpu", "kv_cache_memory": 4 * 2**20, "quantization_check": True}
    source = str(FIXTURES / "awq-w4g64")
    config = LocalBackendConfig("d", "m", tmp_path / "models", LocalEngineOptions(model_path=source, **options))
    with caplog.at_level("INFO", logger="unigate.engine"):
        engine = load_engine(config)
    try:
        stats = engine.engine.stats()
        assert (stats["quantization"], stats["checkpoint_quantization"]) == ("int4", "awq int4 g64")
        assert engine.engine.engine_config.quantization_group_size == 64
    finally:
        engine.stop()
    assert "quantization check skipped: the checkpoint comes quantized (awq int4 g64)" in caplog.text
