"""benchmarks/bench_fidelity.py runs end to end at tiny sizes (its server in another process) and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fidelity_runs_and_prints_a_row_per_level() -> None:
    args = ["--ttft", "0.02", "--itl", "0.005", "--tokens", "3", "--levels", "1,4", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_fidelity.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| unigate bench |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "4"]
    assert all(len(row.split("|")) == 16 for row in rows)  # 14 columns
