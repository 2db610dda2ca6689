"""kv-plan per KV dtype: int8 counts the engine's scales, and the plan agrees with the engine's own capacity."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from bench.cli import register
from bench.kv_plan import from_explicit, kv_bytes_per_token, kv_scale_bytes_per_token, plan
from local_engine.config import KVCapacity, ModelConfig

GIB = 2**30
SMOLLM2 = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3}


def test_int8_adds_a_scale_per_block_and_kv_head() -> None:
    shape = from_explicit(**SMOLLM2)
    assert kv_bytes_per_token(shape, "float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(shape, "bfloat16") == kv_bytes_per_token(shape, "float16") == 23040
    assert kv_scale_bytes_per_token(shape, "int8") == 2 * 30 * 3 * 4 / 16 == 45
    assert kv_bytes_per_token(shape, "int8") == 11520 + 45
    assert kv_scale_bytes_per_token(shape, "fp8") == 0  # only the engine's int8 format carries scales


def test_the_plan_matches_the_engines_capacity_for_each_kv_dtype() -> None:
    """Tokens that fit in one budget, by kv-plan's arithmetic and by the engine's block planning."""
    model = ModelConfig.from_hf_config(
        {"vocab_size": 100, "hidden_size": 576, "intermediate_size": 64, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3}
    )  # fmt: skip
    budget = 256 * 2**20
    for dtype in ("float32", "bfloat16", "float16", "int8"):
        per_block = 16 * model.kv_bytes_per_token(dtype) + model.kv_scale_bytes_per_block(dtype)
        scales = model.kv_scale_bytes_per_block(dtype)
        engine = KVCapacity(budget // per_block, 16, model.kv_bytes_per_token(dtype), dtype, scales)
        planned = budget / kv_bytes_per_token(from_explicit(**SMOLLM2), dtype)
        assert engine.num_tokens <= planned < engine.num_tokens + 16  # the engine rounds down to whole blocks


def test_the_command_shows_bytes_per_token_and_what_fits() -> None:
    app = typer.Typer()
    register(app)
    args = ["kv-plan", "--layers", "30", "--hidden", "576", "--heads", "9", "--kv-heads", "3"]
    shown = CliRunner().invoke(app, [*args, "--kv-dtype", "int8", "--gpu-memory", "1GiB", "--gpu-util", "1"])
    assert shown.exit_code == 0, shown.output
    assert "1 B (int8) + scales 2 × 30 × 3 × 4 B / 16 tokens = 11,565 B" in shown.output
    assert f"= {GIB // 11565:,} tokens" in shown.output
    as_json = CliRunner().invoke(app, [*args, "--kv-dtype", "float32", "--json", "--context", "2048"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output)["kv_bytes_per_token"] == 46080
    assert plan(from_explicit(**SMOLLM2), kv_dtype="int8", gpu_memory_bytes=GIB, utilization=1.0).contexts[0][
        "max_concurrency"
    ] == GIB // (11565 * 2048)
