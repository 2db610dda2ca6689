"""`unigate bench` end to end through typer against the fake server: sweep, SLO search, files, compare."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import typer
from bench_fakes import FakeConfig, FakeServer
from typer.testing import CliRunner

from bench.cli import register
from bench.telemetry import NONE_EXPORTED

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
METRICS_TEXT = """\
# TYPE unigate_engine_kv_cache_usage_ratio gauge
unigate_engine_kv_cache_usage_ratio 0.25
# TYPE unigate_engine_num_preemptions_total counter
unigate_engine_num_preemptions_total 3
# TYPE http_requests_total counter
http_requests_total 9
"""


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def _bench(app: typer.Typer, server: FakeServer, *args: str) -> Any:
    common = ["bench", "--base-url", server.base_url, "--model", "fake-model", "--warmup", "0", "--input-len", "16"]
    return CliRunner().invoke(app, [*common, *args])


def test_sweep_finds_the_highest_concurrency_meeting_the_slo(app: typer.Typer, tmp_path: Path) -> None:
    # One server slot, each request holding it for 50 + 4 × 20 = 130 ms: alone, TTFT is ~50 ms; from concurrency 2
    # on, every request first waits for another one to finish, so TTFT is ~180 ms. The SLO is on p50 so that one
    # scheduling stall on a busy box cannot move the answer.
    config = FakeConfig(ttft_s=0.05, itl_s=0.02, max_concurrent=1, metrics_text=METRICS_TEXT)
    out, table, plot = tmp_path / "run.json", tmp_path / "run.csv", tmp_path / "run.png"
    with FakeServer(config) as server:
        result = _bench(
            app,
            server,
            "--concurrency",
            "1,2,4",
            "--requests",
            "4",
            "--output-len",
            "5",
            "--slo",
            "ttft_p50=120ms",
            "--out",
            str(out),
            "--csv",
            str(table),
            "--plot",
            str(plot),
        )
    assert result.exit_code == 0, result.output
    assert "Highest concurrency meeting the SLO (ttft_p50≤120ms): 1" in result.output
    run = json.loads(out.read_text())
    assert {"config", "environment", "levels", "slo_result"} <= run.keys()
    assert run["config"]["concurrency"] == [1, 2, 4] and "api_key" not in run["config"]
    assert run["environment"]["model"] == "fake-model" and run["environment"]["dtype"] == "float16"
    assert [level["concurrency"] for level in run["levels"]] == [1, 2, 4]
    for level in run["levels"]:
        assert level["requests"] == 4 and level["errors"] == {}
        assert level["request_throughput"] > 0 and level["output_throughput"] > 0
        for name in LATENCIES:
            assert set(level[name]) == {"mean", "p50", "p90", "p95", "p99"}
        metrics = level["telemetry"]["metrics"]
        assert metrics["unigate_engine_kv_cache_usage_ratio"]["after"] == 0.25
        assert "http_requests_total" not in metrics
        assert level["telemetry"]["gpu"] == "not available"
    assert run["slo_result"]["max_concurrency_meeting_slo"] == 1
    assert run["slo_result"]["first_failing"] == 2
    assert run["slo_result"]["breached"][0]["metric"] == "ttft_p50"
    assert run["saturation"] is not None  # one slot: throughput cannot grow (exact levels: test_stats)
    with table.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["concurrency"] for row in rows] == ["1", "2", "4"]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_compare_exits_non_zero_on_a_regression(app: typer.Typer, tmp_path: Path) -> None:
    baseline = tmp_path / "a.json"
    with FakeServer(FakeConfig(ttft_s=0.02, itl_s=0.005)) as server:
        assert (
            _bench(
                app, server, "--concurrency", "1,2", "--requests", "3", "--output-len", "4", "--out", str(baseline)
            ).exit_code
            == 0
        )
    same = CliRunner().invoke(app, ["bench", "compare", str(baseline), str(baseline)])
    assert same.exit_code == 0 and "no regression" in same.output
    run = json.loads(baseline.read_text())
    run["levels"][1]["tpot_ms"]["p95"] *= 1.103
    candidate = tmp_path / "b.json"
    candidate.write_text(json.dumps(run))
    worse = CliRunner().invoke(app, ["bench", "compare", str(baseline), str(candidate)])
    assert worse.exit_code == 1
    assert "TPOT p95 +10.3% at concurrency 2: REGRESSION" in worse.output
    lenient = CliRunner().invoke(app, ["bench", "compare", str(baseline), str(candidate), "--threshold", "15"])
    assert lenient.exit_code == 0


def test_rate_mode_records_rate_levels(app: typer.Typer, tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    with FakeServer(FakeConfig(ttft_s=0.01)) as server:
        result = _bench(app, server, "--rate", "40", "--requests", "5", "--output-len", "3", "--out", str(out))
    assert result.exit_code == 0, result.output
    (level,) = json.loads(out.read_text())["levels"]
    assert level["rate"] == 40.0 and "concurrency" not in level and level["requests"] == 5


def test_a_target_exporting_no_useful_series_says_so(app: typer.Typer, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    with FakeServer(FakeConfig(metrics_text="# TYPE http_requests_total counter\nhttp_requests_total 9\n")) as server:
        result = _bench(app, server, "--concurrency", "1", "--requests", "2", "--output-len", "3", "--out", str(out))
    assert result.exit_code == 0, result.output
    (level,) = json.loads(out.read_text())["levels"]
    assert level["telemetry"]["metrics"] == NONE_EXPORTED  # not an empty {} that reads like a bug


def test_jsonl_dataset_is_sent_as_written(app: typer.Typer, tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "alpha question", "output_len": 3}\n{"prompt": "beta question", "output_len": 6}\n')
    with FakeServer() as server:
        result = _bench(app, server, "--dataset", str(dataset), "--requests", "4", "--concurrency", "1")
        sent = server.config.received[1:]  # the first request is the probe
    assert result.exit_code == 0, result.output
    by_prompt = {body["messages"][0]["content"]: body["max_tokens"] for body in sent}
    assert by_prompt == {"alpha question": 3, "beta question": 6}


def test_errors_are_counted_by_gateway_code(app: typer.Typer, tmp_path: Path) -> None:
    out = tmp_path / "errors.json"
    with FakeServer(FakeConfig(fail_every=3)) as server:  # chat requests 3 and 6 get a 429
        result = _bench(app, server, "--requests", "6", "--output-len", "2", "--out", str(out))
    assert result.exit_code == 0, result.output
    (level,) = json.loads(out.read_text())["levels"]
    assert level["errors"] == {"rate_limit_exceeded": 2} and level["successful"] == 4


def test_a_server_that_refuses_the_probe_stops_the_run_with_advice(app: typer.Typer) -> None:
    with FakeServer(FakeConfig(models=["something-else"])) as server:
        result = _bench(app, server, "--requests", "2")
    assert result.exit_code == 1
    assert "model_not_found" in result.output and "unigate doctor" in result.output


def test_bad_options_are_usage_errors(app: typer.Typer) -> None:
    with FakeServer() as server:
        assert _bench(app, server, "--slo", "fast please", "--requests", "1").exit_code == 2
        assert _bench(app, server, "--input-dist", "zipf:1", "--requests", "1").exit_code == 2
        assert _bench(app, server, "--concurrency", "0", "--requests", "1").exit_code == 2
