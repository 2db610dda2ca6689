"""Per-tenant engine counters keep a bounded label set: the most served tenants, the rest under "other"."""

from __future__ import annotations

from gateway.engine_metrics import fold_tenants


def test_tenants_beyond_the_cap_are_summed_under_other() -> None:
    tenants = {f"k{i}": {"served_tokens": float(i), "preemptions": 1.0} for i in range(5)}
    tenants[""] = {"served_tokens": 100.0, "preemptions": 0.0}
    folded = fold_tenants(tenants, cap=3)
    assert set(folded) == {"anonymous", "k4", "k3", "other"}
    assert folded["other"] == {"served_tokens": 3.0, "preemptions": 3.0}
    assert fold_tenants(tenants) == {("anonymous" if t == "" else t): v for t, v in tenants.items()}
