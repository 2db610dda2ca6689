"""Writes the pre-quantized checkpoints next to this file and, for each, `NAME.reference.safetensors`: the float32
weight every quantized projection stands for, as auto-round's own decoders compute it. Not run by the tests (they read
what it wrote); rerun it by hand after changing the tiny model:

    pip install --no-deps --target /tmp/ar/site auto-round==0.16.1 py-cpuinfo
    pip install --target /tmp/ar/site2 datasets
    .venv/bin/python tests/local_engine/loading/prequantized/make_fixtures.py /tmp/ar/site /tmp/ar/site2

auto-round quantizes on CPU with no network (round-to-nearest, `iters=0`, a calibration set of one repeated line)
and exports the formats other tools write: GPTQ (`auto_gptq`), AWQ (`auto_awq`) and its own (`auto_round`).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# name: (auto-round export format, symmetric, group size)
FIXTURES = {
    "gptq-w4g32": ("auto_gptq", True, 32),
    "awq-w4g64": ("auto_awq", False, 64),
    "autoround-w4g32": ("auto_round", True, 32),
}


def reference_weights(directory: Path) -> dict[str, torch.Tensor]:
    """{module.weight: float32 [N, K]} decoded by auto-round's torch code for the checkpoint's packing."""
    import json

    from auto_round.export.export_to_awq.utils import dequantize_gemm
    from auto_round_extension.torch.qlinear_torch import QuantLinear as GptqNoOffset
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear as GptqZeroMinusOne
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(directory / "model.safetensors"))
    bits, group = int(config["bits"]), int(config["group_size"])
    packing = config.get("packing_format", "")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in tensors if n.endswith(".qweight")):
        module = name.removesuffix(".qweight")
        qweight, qzeros = tensors[f"{module}.qweight"], tensors[f"{module}.qzeros"]
        scales = tensors[f"{module}.scales"].to(torch.float32)  # float32 math: no float16 rounding of scale * q
        if config["quant_method"] == "awq" or packing.endswith("awq"):
            out[f"{module}.weight"] = dequantize_gemm(qweight, qzeros, scales, bits, group).t().contiguous()
            continue
        num_in, num_out = qweight.shape[0] * 32 // bits, qweight.shape[1]
        # GPTQ (v1) and auto-round's `auto_round:auto_gptq` packing store each zero point minus one; auto-round's
        # own `auto_round` / `auto_round:gptqmodel` packings store it as is (auto_round/inference/backend.py).
        minus_one = config["quant_method"] == "gptq" or packing == "auto_round:auto_gptq"
        cls = GptqZeroMinusOne if minus_one else GptqNoOffset
        # Without desc_act g_idx is each input's group in order (the decoders' g_idx branch is not used: in this
        # version it slices the scales by input, which only works for square weights).
        g_idx = tensors.get(f"{module}.g_idx")
        assert g_idx is None or torch.equal(g_idx, torch.arange(num_in, dtype=torch.int32) // group)
        layer = cls(bits, group, num_in, num_out, bias=False)
        layer.qweight, layer.qzeros, layer.scales = qweight, qzeros, scales
        layer.post_init()
        out[f"{module}.weight"] = layer(torch.eye(num_in)).t().contiguous()
    return out


def main() -> None:
    sys.path[:0] = [str(HERE.parents[3]), str(HERE.parent)]
    sys.path += sys.argv[1:]  # where auto-round and its dependencies were installed (after the project's own)
    from auto_round import AutoRound
    from safetensors.torch import load_file, save_file
    from tiny_checkpoints import save_tiny_tokenizer, tiny_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "float"
        model = tiny_model("llama")
        model.save_pretrained(source)
        floats = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
        save_tiny_tokenizer(source)
        for name, (fmt, sym, group) in FIXTURES.items():
            quantizer = AutoRound(
                str(source),
                bits=4,
                group_size=group,
                sym=sym,
                iters=0,
                device_map="cpu",
                dataset=["the quick brown fox jumps over the lazy dog " * 20] * 8,
                nsamples=8,
                seqlen=32,
            )
            written = Path(scratch) / name
            quantizer.quantize_and_save(str(written), format=fmt)
            (inner,) = [p for p in written.iterdir() if p.is_dir()]
            target = HERE / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy(inner / file, target / file)
            reference = reference_weights(target)
            # The decoders were chosen right (a zero point off by one fails this): symmetric, each weight is the float
            # original rounded onto its group's grid scale * (q - 8), q in 0..15 (auto-round's scales clip some
            # outliers on purpose); asymmetric (min-max ranges, nothing clipped), within half a step of it (and the
            # float16 rounding of scale and zero).
            packed = load_file(str(target / "model.safetensors"))
            for key, weight in reference.items():
                scale = packed[key.replace(".weight", ".scales")].to(torch.float32).t().repeat_interleave(group, 1)
                if sym:
                    grid = scale * (torch.clamp(torch.round(floats[key] / scale) + 8, 0, 15) - 8)
                    # (a near-tie may round the other way: auto-round divides by the scale before it becomes float16)
                    ratio = floats[key] / scale
                    near_tie = (ratio - torch.round(ratio)).abs() > 0.49
                    off = (weight - grid).abs()
                    assert ((off == 0) | (near_tie & (off <= scale.abs() * 1.0001))).all(), (name, key)
                else:
                    assert ((weight - floats[key]).abs() <= scale.abs() * 0.51).all(), (name, key)
            save_file(reference, str(HERE / f"{name}.reference.safetensors"))  # beside it: not one of its shards
            print(name, "written")


if __name__ == "__main__":
    main()
