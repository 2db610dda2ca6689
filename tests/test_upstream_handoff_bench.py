"""benchmarks/upstream_handoff.py runs end to end at a tiny size (it is otherwise only run by hand): exit code 0 and
every line it promises is printed. Not a timing assertion."""

from __future__ import annotations

import pytest
from fakes.scripts import run_script


@pytest.mark.timeout(300)
def test_the_hand_off_benchmark_runs_every_case() -> None:
    args = ["benchmarks/upstream_handoff.py", "--pairs", "50", "--handoffs", "50", "--waiters", "10"]
    out = run_script(*args, timeout=240)
    assert out.count("free slot (nobody waits)") == 2
    for num_tenants in (1, 20, 200):
        assert f"hand-off, 10 waiting, {num_tenants:>3} tenant(s)" in out
