"""`unigate bench compare A.json B.json`: B against the baseline A, level by level, with a regression verdict.

A latency figure that grows, or a throughput figure that shrinks, by more than the threshold (percent) at any level
present in both runs is a regression; so is an error rate that rises by more than the threshold in percentage
points. The command exits non-zero when there is one, so it can gate CI.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

__all__ = [
    "COMPARED",
    "Change",
    "changes_table",
    "compare_runs",
    "format_change",
    "level_key",
    "load_run",
    "num_levels_only_in_one",
    "verdict_lines",
]

# (figure path, label, is higher better)
COMPARED: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("request_throughput",), "requests/s", True),
    (("output_throughput",), "output tok/s", True),
    (("ttft_ms", "p50"), "TTFT p50", False),
    (("ttft_ms", "p95"), "TTFT p95", False),
    (("tpot_ms", "p50"), "TPOT p50", False),
    (("tpot_ms", "p95"), "TPOT p95", False),
    (("itl_ms", "p95"), "ITL p95", False),
    (("e2e_ms", "p95"), "E2E p95", False),
)


@dataclass(frozen=True, slots=True)
class Change:
    level_key: str  # concurrency | rate
    level: float
    label: str
    before: float | None
    after: float | None
    change_pct: float | None  # relative change; for the error rate, the change in percentage points
    is_regression: bool

    @property
    def where(self) -> str:
        return f"{self.level_key} {self.level:g}"


def load_run(path: Path) -> dict[str, Any]:
    try:
        run = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"cannot read bench results {path}: {exc}") from None
    if not isinstance(run, dict) or not isinstance(run.get("levels"), list):
        raise ValueError(f"{path} is not a `unigate bench --out` file: it has no 'levels' list")
    return run


def _figure(level: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = level
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, int | float) else None


def _error_rate_pct(level: dict[str, Any]) -> float:
    num_errors = sum(level.get("errors", {}).values())
    return 100.0 * num_errors / level["requests"] if level.get("requests") else 0.0


def level_key(run: dict[str, Any]) -> str:
    """`concurrency` (closed loop) or `rate` (open loop): the field that names each level."""
    return "concurrency" if run["levels"] and "concurrency" in run["levels"][0] else "rate"


def num_levels_only_in_one(baseline: dict[str, Any], candidate: dict[str, Any]) -> int:
    key = level_key(baseline)
    return len({lv[key] for lv in baseline["levels"]} ^ {lv.get(key) for lv in candidate["levels"]})


def compare_runs(baseline: dict[str, Any], candidate: dict[str, Any], threshold_pct: float = 5.0) -> list[Change]:
    key = level_key(baseline)
    if baseline["levels"] and candidate["levels"] and level_key(candidate) != key:
        raise ValueError("one run sweeps concurrency and the other a request rate: compare runs of the same mode")
    after_by_level = {level[key]: level for level in candidate["levels"]}
    changes: list[Change] = []
    for before_level in baseline["levels"]:
        after_level = after_by_level.get(before_level[key])
        if after_level is None:
            continue
        for path, label, is_higher_better in COMPARED:
            before, after = _figure(before_level, path), _figure(after_level, path)
            change = None if before is None or after is None or before == 0 else 100.0 * (after - before) / before
            worse = None if change is None else (-change if is_higher_better else change)
            is_regression = worse is not None and worse > threshold_pct
            changes.append(Change(key, before_level[key], label, before, after, change, is_regression))
        before_rate, after_rate = _error_rate_pct(before_level), _error_rate_pct(after_level)
        points = after_rate - before_rate
        changes.append(
            Change(
                key,
                before_level[key],
                "error rate %",
                before_rate,
                after_rate,
                points,
                points > threshold_pct or (before_rate == 0 and after_rate > 0),
            )
        )
    return changes


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_change(change: Change) -> str:
    """`+10.3%`, or `+2.0 pt` for the error rate; `-` when there is nothing to compare."""
    unit = " pt" if change.label == "error rate %" else "%"
    return "-" if change.change_pct is None else f"{change.change_pct:+.1f}{unit}"


def changes_table(changes: list[Change], title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for column in ("level", "figure", "A", "B", "change", "verdict"):
        table.add_column(column, justify="right" if column not in ("figure", "verdict") else "left")
    for change in changes:
        verdict = "[bold red]REGRESSION[/]" if change.is_regression else "ok"
        table.add_row(
            change.where, change.label, _fmt(change.before), _fmt(change.after), format_change(change), verdict
        )
    return table


def verdict_lines(changes: list[Change], num_levels_only_in_one: int = 0) -> list[str]:
    """E.g. `TPOT p95 +10.3% at concurrency 32: REGRESSION`, one line per regression, or a single all-clear."""
    lines = []
    for change in changes:
        if change.is_regression:
            delta = "" if change.change_pct is None else f" {format_change(change)}"
            lines.append(f"{change.label}{delta} at {change.where}: REGRESSION")
    if not lines:
        lines.append("no regression beyond the threshold")
    if num_levels_only_in_one:
        lines.append(f"{num_levels_only_in_one} level(s) appear in only one run and were not compared")
    return lines
