"""benchmarks/observability_cost.py runs end to end at a tiny size: four configurations of real gateway workers
(baseline, request log, log + 100% tracing, log + 1%), each its own processes and embedded Redis, the traced ones
exporting through their span sender process to the script's OTLP receiver."""

from __future__ import annotations

import pytest
from fakes.scripts import run_script


@pytest.mark.timeout(300)
def test_the_benchmark_prints_a_row_per_configuration_and_the_spans_arrive() -> None:
    out = run_script(
        "benchmarks/observability_cost.py",
        "--seconds",
        "0.3",
        "--rounds",
        "2",
        "--processes",
        "1",
        "--concurrency",
        "2",
    )
    rows = {
        line[:12].strip(): line[12:].split()
        for line in out.splitlines()
        if line.startswith(("baseline", "request log", "log +"))
    }
    assert list(rows) == ["baseline", "request log", "log + trace", "log + 1%"]
    assert rows["baseline"][1] == "1.00"  # its own ratio
    assert all(row[-1] == "0" for row in rows.values())  # errors
    exports = next(line for line in out.splitlines() if line.startswith("OTLP receiver:")).split()
    assert int(exports[2]) >= 1 and float(exports[4]) > 0  # "OTLP receiver: N exports, X MB"
