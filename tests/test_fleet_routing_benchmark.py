"""benchmarks/fleet_routing.py runs end to end at a tiny size: every policy, one and two gateways, the table; and
SLO-aware admission's scenario."""

from __future__ import annotations

import pytest
from fakes.scripts import run_script


@pytest.mark.timeout(300)
def test_fleet_routing_benchmark_quick_run_prints_every_policy() -> None:
    out = run_script("benchmarks/fleet_routing.py", "--quick", "--time-scale", "0.25", timeout=280)
    for policy in ("round_robin", "least_in_flight", "least_load", "prefix_affinity", "prefix_affinity, 2 gateways"):
        assert f"| 4 | {policy} |" in out
    assert "one infinitely large replica's hit rate" in out
    for admission in ("none", "slo", "slo, seeded"):  # SLO-aware admission at twice the fleet's capacity
        assert f"| {admission} | " in out
