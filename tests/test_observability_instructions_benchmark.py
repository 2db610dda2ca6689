"""benchmarks/observability_instructions.py runs end to end at a tiny size without valgrind (process CPU time): each
configuration's real gateway process sent exactly N1, then N2 requests, and a row per configuration."""

from __future__ import annotations

import pytest
from fakes.scripts import run_script


@pytest.mark.timeout(300)
def test_the_benchmark_counts_each_configuration_between_two_request_counts() -> None:
    out = run_script(
        "benchmarks/observability_instructions.py",
        "--no-valgrind",
        "--requests",
        "20,220",
        "--concurrency",
        "4",
        "--configs",
        "baseline,request log,log + trace",
    )
    assert "counted over requests 20..220" in out and "process CPU time" in out
    rows = {
        line[:12].strip(): line[12:].split()
        for line in out.splitlines()
        if line.startswith(("baseline", "request log", "log +"))
    }
    assert list(rows) == ["baseline", "request log", "log + trace"]
    assert rows["baseline"][1] == "1.000"  # its own share
    assert len(rows["log + trace"]) == 3  # cost, kept, vs log
    exports = next(line for line in out.splitlines() if line.startswith("OTLP receiver:")).split()
    assert int(exports[2]) >= 1  # the traced gateway's spans arrived (sent at its stop)
