"""Percentiles, SLO parsing, the SLO search and saturation, on hand-made figures."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from bench.client import RequestResult
from bench.loadgen import LevelRun, LevelSpec
from bench.stats import find_saturation, level_figures, parse_slo, percentile, slo_result, summarize


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert math.isnan(percentile([], 50))
    assert summarize([]) == dict.fromkeys(("mean", "p50", "p90", "p95", "p99"))
    assert summarize([2.0, 4.0])["mean"] == 3.0


def test_slo_parsing_units_and_errors() -> None:
    targets = parse_slo("ttft_p95=500ms, tpot_p95=0.05s,itl_p99=800us,e2e_mean=2")
    assert [(t.name, t.threshold_ms) for t in targets] == [
        ("ttft_p95", 500.0),
        ("tpot_p95", 50.0),
        ("itl_p99", 0.8),
        ("e2e_mean", 2.0),
    ]
    assert parse_slo(None) == [] and parse_slo("") == []
    for bad in ("ttft=500ms", "ttft_p97=1ms", "latency_p95=1ms", "ttft_p95=fast"):
        with pytest.raises(ValueError, match="cannot read SLO"):
            parse_slo(bad)


def _result(ttft: float, e2e: float, tokens: int, error: str | None = None) -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(0.0, e2e, ttft, gaps, tokens, 10, error, 200, True)


def test_level_figures_count_errors_goodput_and_tpot() -> None:
    run = LevelRun(LevelSpec(concurrency=4, max_requests=4), wall_s=2.0)
    run.results = [
        _result(0.1, 1.0, 10),
        _result(0.6, 1.5, 10),
        _result(0.1, 0.1, 1, "rate_limit_exceeded"),
        _result(0.1, 0.1, 1, "rate_limit_exceeded"),
    ]
    figures = level_figures(run, parse_slo("ttft_p95=500ms"))
    assert figures["concurrency"] == 4 and figures["requests"] == 4 and figures["successful"] == 2
    assert figures["errors"] == {"rate_limit_exceeded": 2}
    assert figures["request_throughput"] == 1.0 and figures["output_throughput"] == 10.0
    assert figures["goodput"] == 0.5  # only the first request met ttft <= 500 ms
    assert figures["tpot_ms"]["p50"] == pytest.approx(((0.9 / 9) + (0.9 / 9)) / 2 * 1000)
    assert figures["ttft_ms"]["mean"] == pytest.approx(350.0)


def _level(concurrency: int, ttft_p95: float | None, throughput: float) -> dict[str, Any]:
    empty = dict.fromkeys(("mean", "p50", "p90", "p95", "p99"))
    return {
        "concurrency": concurrency,
        "ttft_ms": {**empty, "p95": ttft_p95},
        "tpot_ms": {**empty, "p95": 20.0},
        "output_throughput": throughput,
    }


def test_slo_result_is_the_last_level_before_the_first_failure() -> None:
    levels = [_level(1, 100, 10), _level(8, 300, 70), _level(16, 700, 100), _level(32, 400, 101)]
    result = slo_result(levels, parse_slo("ttft_p95=500ms,tpot_p95=50ms"))
    assert result["max_concurrency_meeting_slo"] == 8
    assert result["first_failing"] == 16
    assert result["breached"] == [{"metric": "ttft_p95", "value_ms": 700, "threshold_ms": 500.0}]
    assert slo_result(levels, [])["max_concurrency_meeting_slo"] is None
    failing_at_once = slo_result([_level(1, None, 0)], parse_slo("ttft_p95=1ms"))
    assert failing_at_once["max_concurrency_meeting_slo"] is None and failing_at_once["first_failing"] == 1


def test_saturation_is_where_throughput_stops_growing() -> None:
    levels = [_level(1, 1, 10), _level(8, 1, 70), _level(16, 1, 100), _level(32, 1, 104)]
    assert find_saturation(levels) == {"concurrency": 16, "output_throughput": 100}
    assert find_saturation(levels[:3]) is None


def test_a_plateau_followed_by_growth_is_not_saturation() -> None:
    levels = [_level(1, 1, 20), _level(8, 1, 75), _level(16, 1, 77), _level(32, 1, 122), _level(64, 1, 125)]
    assert find_saturation(levels) == {"concurrency": 32, "output_throughput": 122}


def test_speculative_acceptance_sums_the_servers_counters_over_levels() -> None:
    from bench.telemetry import interesting_samples, metrics_delta, speculative_acceptance

    def page(proposed: int, accepted: int) -> str:
        return (
            "# TYPE unigate_engine_spec_proposed_tokens counter\n"
            f'unigate_engine_spec_proposed_tokens_total{{model="local"}} {proposed}\n'
            "# TYPE unigate_engine_spec_accepted_tokens counter\n"
            f'unigate_engine_spec_accepted_tokens_total{{model="local"}} {accepted}\n'
        )

    pages = [page(0, 0), page(40, 22), page(100, 61)]
    levels = [
        {"telemetry": {"metrics": metrics_delta(interesting_samples(a), interesting_samples(b))}}
        for a, b in itertools.pairwise(pages)
    ]
    assert speculative_acceptance(levels) == {"proposed": 100, "accepted": 61, "acceptance_rate": 0.61}
    vllm = "vllm:spec_decode_num_draft_tokens_total 30\nvllm:spec_decode_num_accepted_tokens_total 12\n"
    level = {"telemetry": {"metrics": metrics_delta({}, interesting_samples(vllm))}}
    assert speculative_acceptance([level]) == {"proposed": 30, "accepted": 12, "acceptance_rate": 0.4}
    assert speculative_acceptance([{"telemetry": {"metrics": "not available"}}]) is None
    assert (
        speculative_acceptance([{"telemetry": {"metrics": metrics_delta({}, interesting_samples(page(0, 0)))}}]) is None
    )
