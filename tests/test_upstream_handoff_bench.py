"""benchmarks/upstream_handoff.py runs end to end at a tiny size (it is otherwise only run by hand): exit code 0 and
every line it promises is printed. Not a timing assertion."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_hand_off_benchmark_runs_every_case() -> None:
    args = ["benchmarks/upstream_handoff.py", "--pairs", "50", "--handoffs", "50", "--waiters", "10"]
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("free slot (nobody waits)") == 2
    for num_tenants in (1, 20, 200):
        assert f"hand-off, 10 waiting, {num_tenants:>3} tenant(s)" in result.stdout
