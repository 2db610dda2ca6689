"""The regression verdict on hand-made runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bench.compare import compare_runs, verdict_lines


def _run(key: str = "concurrency") -> dict[str, Any]:
    def figures(p95: float) -> dict[str, float]:
        return {"mean": p95 / 2, "p50": p95 / 2, "p90": p95, "p95": p95, "p99": p95}

    levels = [
        {
            key: level,
            "requests": 100,
            "errors": {},
            "request_throughput": 10.0 * level,
            "output_throughput": 1000.0 * level,
            "ttft_ms": figures(100.0),
            "tpot_ms": figures(50.0),
            "itl_ms": figures(50.0),
            "e2e_ms": figures(1000.0),
        }
        for level in (1, 32)
    ]
    return {"config": {}, "environment": {}, "levels": levels, "slo_result": {}}


def test_identical_runs_have_no_regression() -> None:
    changes = compare_runs(_run(), _run())
    assert not any(c.is_regression for c in changes)
    assert verdict_lines(changes) == ["no regression beyond the threshold"]


def test_latency_up_and_throughput_down_are_regressions() -> None:
    candidate = _run()
    candidate["levels"][1]["tpot_ms"]["p95"] = 55.15  # +10.3 %
    candidate["levels"][1]["output_throughput"] = 32000 * 0.9
    candidate["levels"][0]["ttft_ms"]["p95"] = 104.0  # +4 %: inside the default 5 %
    lines = verdict_lines(compare_runs(_run(), candidate))
    assert "TPOT p95 +10.3% at concurrency 32: REGRESSION" in lines
    assert "output tok/s -10.0% at concurrency 32: REGRESSION" in lines
    assert not any("TTFT" in line for line in lines)


def test_improvements_are_not_regressions() -> None:
    candidate = _run()
    candidate["levels"][1]["tpot_ms"]["p95"] = 25.0
    candidate["levels"][1]["request_throughput"] = 640.0
    assert not any(c.is_regression for c in compare_runs(_run(), candidate))


def test_new_errors_are_a_regression() -> None:
    candidate = copy.deepcopy(_run())
    candidate["levels"][0]["errors"] = {"upstream_timeout": 1}
    lines = verdict_lines(compare_runs(_run(), candidate))
    assert lines == ["error rate % +1.0 pt at concurrency 1: REGRESSION"]


def test_runs_of_different_modes_do_not_compare() -> None:
    with pytest.raises(ValueError, match="same mode"):
        compare_runs(_run("concurrency"), _run("rate"))
