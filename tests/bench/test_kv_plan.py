"""kv-plan against figures computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench.cli import register
from bench.kv_plan import (
    from_explicit,
    from_gguf,
    from_hf_config,
    kv_bytes_per_token,
    parse_count,
    parse_size,
    plan,
)
from local_engine.loader import bundled_model_path

KIB, GIB = 2**10, 2**30
SMOLLM2_GGUF = bundled_model_path()
LLAMA2_7B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float16",
    "tie_word_embeddings": False,
}


def test_7b_at_32_layers_4096_hidden_fp16_is_512_kib_per_token() -> None:
    shape = from_explicit(32, 4096, 32)
    assert shape.head_dim == 128 and shape.num_kv_heads == 32
    assert kv_bytes_per_token(shape, "fp16") == 512 * KIB  # 2 × 32 × 4096 × 2 B


def test_32_sequences_of_2048_tokens_take_32_gib() -> None:
    kv = plan(from_explicit(32, 4096, 32), gpu_memory_bytes=32 * GIB, utilization=1.0, contexts=[2048, 4096])
    assert kv.contexts[0]["kv_bytes_per_sequence"] == 1 * GIB
    assert [row["max_concurrency"] for row in kv.contexts] == [32, 16]
    one_byte_short = plan(from_explicit(32, 4096, 32), gpu_memory_bytes=32 * GIB - 1, utilization=1.0, contexts=[2048])
    assert one_byte_short.contexts[0]["max_concurrency"] == 31


def test_gqa_with_8_kv_heads_is_128_kib_per_token() -> None:
    assert kv_bytes_per_token(from_explicit(32, 4096, 32, num_kv_heads=8), "fp16") == 128 * KIB
    assert kv_bytes_per_token(from_explicit(32, 4096, 32, num_kv_heads=8), "fp8") == 64 * KIB


def test_weights_are_subtracted_from_the_kv_budget() -> None:
    shape = from_explicit(32, 4096, 32, num_params=parse_count("7B"))
    kv = plan(shape, gpu_memory_bytes=parse_size("80GiB"), utilization=0.9, contexts=[2048])
    assert kv.weights_bytes == 14e9
    assert kv.kv_budget_bytes == pytest.approx(80 * GIB * 0.9 - 14e9)
    assert kv.contexts[0]["max_concurrency"] == int((80 * GIB * 0.9 - 14e9) // GIB)


def test_hf_config_gives_the_llama2_7b_parameter_count(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B_CONFIG))
    shape = from_hf_config(tmp_path)
    assert shape.num_params == 6_738_415_616 and shape.is_num_params_estimated
    assert kv_bytes_per_token(shape, "fp16") == 512 * KIB and shape.max_context == 4096


def test_safetensors_headers_give_exact_parameters(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = {
        **LLAMA2_7B_CONFIG,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"a": torch.zeros(3, 5, dtype=torch.float16), "b": torch.zeros(7)}, str(tmp_path / "model.safetensors"))
    shape = from_hf_config(tmp_path / "config.json")
    assert shape.num_params == 22 and not shape.is_num_params_estimated
    assert shape.weights_bytes_stored == 3 * 5 * 2 + 7 * 4
    assert kv_bytes_per_token(shape, "bf16") == 2 * 2 * 2 * 16 * 2


def test_a_weights_cache_entry_counts_each_weight_once(tmp_path: Path) -> None:
    """unigate's cache of a converted GGUF keeps the quantised blocks (raw bytes) beside the dequantised float32
    weights under the same names: the blocks are not more parameters, and the config names no dtype."""
    import numpy as np
    from safetensors.numpy import save_file

    from local_engine.weights_cache import BLOCKS_FILE, WEIGHTS_FILE

    config = {key: value for key, value in LLAMA2_7B_CONFIG.items() if key != "torch_dtype"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "hidden_size": 64}))
    weights = {"embed.weight": np.zeros((8, 4), np.float32), "norm.weight": np.zeros(4, np.float32)}
    save_file(weights, str(tmp_path / WEIGHTS_FILE))
    save_file(
        {"embed.weight": np.zeros((8, 20), np.uint8)}, str(tmp_path / BLOCKS_FILE), metadata={"embed.weight": "Q4_1"}
    )
    shape = from_hf_config(tmp_path)
    assert shape.num_params == 8 * 4 + 4 and not shape.is_num_params_estimated
    assert shape.weights_bytes_stored == (8 * 4 + 4) * 4 and shape.stored_dtype == "float32"
    app = typer.Typer()
    register(app)
    shown = CliRunner().invoke(app, ["kv-plan", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert "(as stored in the file, float32: 144 B)" in shown.output and "None" not in shown.output


def test_a_gptq_checkpoint_counts_its_packed_parameters() -> None:
    """A GPTQ folder (tests/local_engine/loading/prequantized/, auto-round 0.16.1): each int32 of a qweight holds 8
    4-bit weights; qzeros, scales and g_idx are bytes, not parameters. The float model it came from has 107,712."""
    folder = Path(__file__).parents[1] / "local_engine" / "loading" / "prequantized" / "gptq-w4g32"
    shape = from_hf_config(folder)
    assert shape.num_params == 107_712 and shape.stored_dtype == "gptq 4-bit, packed"
    data = (folder / "model.safetensors").read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    assert shape.weights_bytes_stored == len(data) - 8 - header_len  # every tensor's bytes, packed as stored


def test_bundled_smollm2_gguf() -> None:
    shape = from_gguf(SMOLLM2_GGUF)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert shape.max_context == 8192
    assert kv_bytes_per_token(shape, "fp16") == 2 * 30 * 3 * 64 * 2 == 23040
    assert kv_bytes_per_token(shape, "fp32") == 2 * 30 * 3 * 64 * 4
    assert 130e6 < shape.num_params < 140e6  # SmolLM2-135M
    assert shape.weights_bytes_stored is not None and shape.weights_bytes_stored < shape.num_params  # 4-bit


def test_cli_shows_the_formula_and_json(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    shown = CliRunner().invoke(
        app,
        [
            "kv-plan",
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--heads",
            "32",
            "--kv-heads",
            "8",
            "--gpu-memory",
            "24GiB",
            "--gpu-util",
            "1",
            "--params",
            "7B",
        ],
    )
    assert shown.exit_code == 0, shown.output
    assert "2 (K,V) × 32 layers × 8 kv heads × 128 head dim × 2 B (fp16) = 131,072 B = 128.00 KiB" in shown.output
    assert "max concurrency = floor(KV budget / (KV per token × context))" in shown.output
    as_json = CliRunner().invoke(
        app,
        [
            "kv-plan",
            "--layers",
            "32",
            "--hidden",
            "4096",
            "--heads",
            "32",
            "--gpu-memory",
            "32GiB",
            "--gpu-util",
            "1",
            "--context",
            "2048",
            "--json",
        ],
    )
    assert json.loads(as_json.output)["contexts"][0]["max_concurrency"] == 32
    missing = CliRunner().invoke(app, ["kv-plan", "--layers", "32"])
    assert missing.exit_code == 2


def test_bad_inputs_say_what_to_write() -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="parameter count"):
        parse_count("seven")
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_bytes_per_token(from_explicit(1, 64, 1), "fp12")
