"""benchmarks/fleet_routing.py runs end to end at a tiny size: every policy, one and two gateways, the table; and
SLO-aware admission's scenario."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_fleet_routing_benchmark_quick_run_prints_every_policy() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/fleet_routing.py", "--quick", "--time-scale", "0.5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for policy in ("round_robin", "least_in_flight", "least_load", "prefix_affinity", "prefix_affinity, 2 gateways"):
        assert f"| 4 | {policy} |" in result.stdout
    assert "one infinitely large replica's hit rate" in result.stdout
    for admission in ("none", "slo", "slo, seeded"):  # SLO-aware admission at twice the fleet's capacity
        assert f"| {admission} | " in result.stdout
