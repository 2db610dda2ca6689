"""The GPU benchmark, the CPU attention, projection and decode-step benchmarks and the engine benchmark's op
profile run end to end at tiny sizes (they are otherwise only run by hand, the GPU one on the rare machine that has
a GPU): exit code 0 and every table they promise is printed."""

from __future__ import annotations

import pytest
from fakes.scripts import run_script as run

from local_engine.kernels import cpu as cpu_kernels

# Each test runs a benchmark script (real models, a subprocess): generous limits, since a loaded 2-core machine
# can take several times as long as a quiet one. They bound hangs; they are not timing assertions.
pytestmark = pytest.mark.timeout(600)


def test_gpu_engine_cpu_smoke_runs_every_section() -> None:
    out = run("benchmarks/gpu_engine.py", "--cpu-smoke")
    assert "## Kernel checks" in out and "| NO " not in out and "kernel checks passed" in out
    assert "## Decode attention" in out and "% of copy bw" in out
    assert "| tiny  | unigate     |" in out and "| tiny  | hf generate |" in out
    assert "engine section skipped" not in out


@pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
def test_cpu_attention_benchmark_runs() -> None:
    out = run("benchmarks/cpu_attention.py", "--seqs", "3", "--layers", "2", "--min-len", "10", "--max-len", "60")
    for variant in ("torch path, blocks shuffled", "C kernel, blocks shuffled", "hot", "C kernel, blocks in order"):
        assert variant in out
    assert "KV read per step" in out


@pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
def test_cpu_linear_benchmark_runs() -> None:
    out = run("benchmarks/cpu_linear.py", "--layers", "1", "--rows", "1,9", "--repeats", "1", "--mkl")
    for path in ("oneDNN packed", "cpu_kernels", "F.linear (MKL)"):
        assert out.count(path) == 3, path  # milliseconds, GFLOP/s and GB/s
    assert "GFLOP/s" in out and "weight GB/s" in out


@pytest.mark.skipif(not cpu_kernels.is_available(), reason="the native CPU kernels do not build here")
def test_cpu_decode_steps_benchmark_runs() -> None:
    out = run("benchmarks/cpu_decode_steps.py", "--batches", "1,3", "--prompt", "20", "--rounds", "1")
    assert "GGUF blocks: {'Q4_1': 120, 'Q8_0': 1}" in out  # the bundled model's projections and output embedding
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "3"] and all(len(row) == 4 for row in rows)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "op-by-op"])
def test_engine_throughput_profiles_the_engine_ops(fused: bool) -> None:
    # The bundled model (installed by `make`); its converted weights are cached under .unigate/models.
    flags = [] if fused else ["--no-fused-decode"]
    out = run("benchmarks/engine_throughput.py", "--quick", "--skip-hf", "--num-requests", "2", "--profile-ops", *flags)
    assert "where the engine's" in out
    # With the decode steps in one native call (the default where the kernels build) they are one item.
    decode = "decode steps (cpu_decode)" if fused and cpu_kernels.is_available() else "paged_decode_attention"
    for label in ("projections", "logits", decode, "paged_prefill_attention", "rms_norm", "sampler"):
        assert f"  {label} " in out, label
    assert "unigate engine  TTFT" in out  # the batch-1 run after it, on the unwrapped ops


def test_engine_throughput_alternates_rounds_against_transformers() -> None:
    out = run("benchmarks/engine_throughput.py", "--quick", "--num-requests", "2", "--rounds", "2")
    rows = [line.split("  ")[0] for line in out.splitlines() if line.startswith(("unigate engine #", "transformers"))]
    assert rows == [
        "unigate engine #1",
        "transformers static bs=8 #1",
        "unigate engine #2",
        "transformers static bs=8 #2",
    ]
    # Each round computes every prompt again: nothing is served from the last round's prefix cache.
    engine_rows = [line for line in out.splitlines() if line.startswith("unigate engine #")]
    assert all("prefix_hit_tokens=0" in line for line in engine_rows)
    ratios = [line for line in out.splitlines() if "vs best static" in line]
    assert len(ratios) == 2 and all(line.rstrip().endswith("x") for line in ratios)
    assert "throughput vs median of 2 rounds:" in out
    assert "transformers    TTFT" in out


def test_quantization_benchmark_prints_the_table() -> None:
    # The baseline row and one row with both settings (quantized weights, int8 KV) at the tiniest sizes; one
    # thread, as a loaded 2-core host runs it fastest.
    args = ("--smoke", "--threads", "1", "--weights", "float32,int4", "--kv", "model,int8")
    out = run("benchmarks/quantization.py", *args)
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| weights")]
    assert [row.split("|")[1].strip() for row in rows] == [
        "float32 / KV model",
        "float32 / KV int8",
        "int4 / KV model",
        "int4 / KV int8",
    ]
    cells = [[cell.strip() for cell in row.split("|")[2:-1]] for row in rows]
    assert all(len(row) == 9 for row in cells), cells  # every column measured, no row left out
    assert cells[0][4] == "+0.00%" and cells[0][5] == "4.0 / 4"  # float32 against itself
    kv_bytes = [int(row[1]) for row in cells]
    assert kv_bytes[1] * 3 < kv_bytes[0]  # int8 KV: 1 byte per element (+ scales) against 4


def test_usage_rows_benchmark_compares_both_reads() -> None:
    out = run("benchmarks/usage_rows.py", "--keys", "25", "--rounds", "1")  # it asserts both reads agree
    assert "25 keys, 1 day each: key by key" in out and "usage_many" in out
