"""Showing and saving results: rich live progress, the final table, the conclusions, JSON (the baseline archive),
CSV and PNG. The HTML report is `bench.report_html`."""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from bench.client import RequestResult
from bench.stats import METRICS, STATS, percentile

__all__ = ["Conclusion", "LiveProgress", "conclusions", "levels_table", "write_csv", "write_json", "write_plot"]


class LiveProgress:
    """Level, elapsed time, requests done and errors, current p50 TTFT; redrawn at most four times a second."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._live: Live | None = None
        self._label = ""
        self._started = 0.0
        self._num_done = 0
        self._num_errors = 0
        self._ttfts_ms: list[float] = []

    def start_level(self, label: str) -> None:
        self._label, self._started = label, time.perf_counter()
        self._num_done, self._num_errors, self._ttfts_ms = 0, 0, []
        if self.console.is_terminal:
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def on_result(self, result: RequestResult) -> None:
        self._num_done += 1
        self._num_errors += not result.is_ok
        if result.ttft_s is not None:
            self._ttfts_ms.append(result.ttft_s * 1000)

    def end_level(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.console.print(self._render())

    def _render(self) -> RenderableType:
        p50 = f"{percentile(self._ttfts_ms, 50):.1f} ms" if self._ttfts_ms else "-"
        return Text.assemble(
            (f"{self._label:>18}", "bold cyan"),
            f"  elapsed {time.perf_counter() - self._started:6.1f} s",
            f"  done {self._num_done:5d}",
            (f"  errors {self._num_errors}", "red" if self._num_errors else "dim"),
            f"  TTFT p50 {p50}",
        )


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def levels_table(levels: list[dict[str, Any]], title: str = "unigate bench") -> Table:
    key = "concurrency" if levels and "concurrency" in levels[0] else "rate"
    table = Table(title=title, header_style="bold")
    for column in (key, "ok/total", "errors", "req/s", "out tok/s", "goodput"):
        table.add_column(column, justify="right")
    for metric in ("ttft", "tpot", "itl", "e2e"):
        table.add_column(f"{metric.upper()} p50/p95 ms", justify="right")
    for level in levels:
        errors = ", ".join(f"{code}:{n}" for code, n in level["errors"].items()) or "-"
        row = [
            f"{level[key]:g}",
            f"{level['successful']}/{level['requests']}",
            errors,
            _fmt(level["request_throughput"], 2),
            _fmt(level["output_throughput"]),
            _fmt(level["goodput"], 2),
        ]
        for metric in ("ttft", "tpot", "itl", "e2e"):
            figures = level[f"{metric}_ms"]
            row.append(f"{_fmt(figures['p50'])} / {_fmt(figures['p95'])}")
        table.add_row(*row)
    return table


@dataclass(frozen=True, slots=True)
class Conclusion:
    kind: str  # good | bad | detail | info | warning
    text: str


def conclusions(run: dict[str, Any]) -> list[Conclusion]:
    """What the run found, in words: the highest level meeting the SLO (or none), what the first failing level
    missed, the saturation point and the run's warnings. Shared by the terminal and the HTML report."""
    found: list[Conclusion] = []
    result, saturation = run["slo_result"], run["saturation"]
    key = "rate" if run["config"]["mode"] == "rate" else "concurrency"
    if result["slo"]:
        best = result[f"max_{key}_meeting_slo"]
        slo_text = ", ".join(f"{name}≤{ms:g}ms" for name, ms in result["slo"].items())
        if best is None:
            found.append(Conclusion("bad", f"No level meets the SLO ({slo_text})."))
        else:
            found.append(Conclusion("good", f"Highest {key} meeting the SLO ({slo_text}): {best:g}"))
        for miss in result["breached"]:
            value = "no successful request" if miss["value_ms"] is None else f"{miss['value_ms']:.1f} ms"
            found.append(
                Conclusion(
                    "detail",
                    f"at {key} {result['first_failing']:g}: {miss['metric']} = {value} > {miss['threshold_ms']:g} ms",
                )
            )
    if saturation is not None:
        found.append(
            Conclusion(
                "info",
                f"Throughput stops growing after {key} {saturation[key]:g} "
                f"({saturation['output_throughput']:.1f} output tokens/s).",
            )
        )
    found.extend(Conclusion("warning", warning) for warning in run["warnings"])
    return found


def write_json(path: Path, run: dict[str, Any]) -> None:
    path.write_bytes(orjson.dumps(run, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def write_csv(path: Path, levels: list[dict[str, Any]]) -> None:
    key = "concurrency" if levels and "concurrency" in levels[0] else "rate"
    scalars = ["requests", "successful", "request_throughput", "output_throughput", "total_throughput", "goodput"]
    columns = [key, *scalars, "errors"] + [f"{m}_ms_{s}" for m in METRICS for s in STATS]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for level in levels:
            errors = ";".join(f"{code}:{n}" for code, n in level["errors"].items())
            row = [level[key], *(level[name] for name in scalars), errors]
            row += [level[f"{m}_ms"][s] for m in METRICS for s in STATS]
            writer.writerow(["" if value is None else value for value in row])


def write_plot(path: Path, levels: list[dict[str, Any]], title: str) -> None:
    """Throughput vs load, and TTFT / TPOT p95 vs load, side by side."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "concurrency" if levels and "concurrency" in levels[0] else "rate"
    xs = [level[key] for level in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", label="output tokens/s")
    left.set_xlabel(key)
    left.set_ylabel("output tokens/s")
    requests_axis = left.twinx()
    requests_axis.plot(xs, [lv["request_throughput"] for lv in levels], marker="s", color="tab:orange")
    requests_axis.set_ylabel("requests/s", color="tab:orange")
    left.set_title("throughput")
    for metric, colour in (("ttft", "tab:blue"), ("tpot", "tab:red")):
        values = [lv[f"{metric}_ms"]["p95"] for lv in levels]
        right.plot(
            xs,
            [float("nan") if v is None else v for v in values],
            marker="o",
            color=colour,
            label=f"{metric.upper()} p95",
        )
    right.set_xlabel(key)
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    right.legend()
    right.set_title("latency p95")
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
        if key == "concurrency" and len(xs) > 1 and max(xs) / max(min(xs), 1) >= 8:
            axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [f"{x:g}" for x in xs])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
