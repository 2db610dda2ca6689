"""benchmarks/gateway_overhead.py: its tail figure is each round's own p99 / p50 (the median over rounds), and the
script runs end to end (fast fake upstream, one real gateway worker, embedded Redis) at a tiny size; so does
benchmarks/gateway_tail.py, the gateway's GC and event-loop probes included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fakes.scripts import run_script  # noqa: E402
from gateway_overhead import Result  # noqa: E402  (a script, not a package)


def test_the_tail_is_the_median_of_each_rounds_own_ratio() -> None:
    calm = Result(100, 1.0, [10.0] * 99 + [20.0], 0)  # p50 10, p99 20
    busy = Result(100, 1.0, [100.0] * 99 + [200.0], 0)  # p50 100, p99 200
    assert calm.tail == busy.tail == 2.0
    pooled = calm.plus(busy).plus(calm)
    # Pooled, the busy round's latencies make a p99 (100) ten times the pooled p50 (10): no round had that tail.
    assert pooled.percentile(0.99) / pooled.percentile(0.5) == 10.0
    assert pooled.tail == 2.0
    assert pooled.num_requests == 300 and len(pooled.tails) == 3


@pytest.mark.timeout(300)
def test_the_benchmark_prints_a_row_per_mode_and_concurrency() -> None:
    result = run_script(
        "benchmarks/gateway_overhead.py",
        "--seconds",
        "0.4",
        "--rounds",
        "2",
        "--concurrency",
        "1,4",
        "--modes",
        "non-stream",
    )
    rows = [line.split() for line in result.splitlines() if line.startswith(("non-stream", "stream"))]
    assert [(row[0], row[1]) for row in rows] == [("non-stream", "1"), ("non-stream", "4")]
    for row in rows:
        assert row[-1] == "0"  # errors
        gateway_tail = float(row[11])  # mode c | direct req/s p50 p99 tail | gateway req/s p50 p99 tail | ...
        assert gateway_tail >= 1.0


@pytest.mark.timeout(300)
def test_the_tail_probe_reports_latency_gc_and_who_was_slow() -> None:
    result = run_script("benchmarks/gateway_tail.py", "--concurrency", "4", "--seconds", "0.5", "--gc-threshold", "700")
    out = result
    assert "c=4: gateway CPU" in out and "p99/p50" in out and "were slow together" in out
    assert "GC generation 0:" in out  # a threshold of 700 collects many times in half a second of requests
