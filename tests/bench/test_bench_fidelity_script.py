"""benchmarks/bench_fidelity.py runs end to end at tiny sizes (its server in another process) and prints its table."""

from __future__ import annotations

from fakes.scripts import run_script


def test_bench_fidelity_runs_and_prints_a_row_per_level() -> None:
    args = ["--ttft", "0.02", "--itl", "0.005", "--tokens", "3", "--levels", "1,4", "--rounds", "2"]
    out = run_script("benchmarks/bench_fidelity.py", *args, timeout=120)
    rows = [line for line in out.splitlines() if line.startswith("| unigate bench |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "4"]
    assert all(len(row.split("|")) == 16 for row in rows)  # 14 columns
