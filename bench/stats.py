"""Figures per level, SLO parsing and checking, the highest level meeting the SLO, and saturation.

Percentiles interpolate linearly between closest ranks (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.client import RequestResult
from bench.loadgen import LevelRun

__all__ = [
    "METRICS",
    "STATS",
    "SloTarget",
    "breaches",
    "find_saturation",
    "level_figures",
    "parse_slo",
    "percentile",
    "slo_result",
    "summarize",
]

METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p95", "p99")
_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}
SATURATION_GROWTH = 0.10  # a level whose throughput grows less than 10% over the previous one is saturated


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p95/p99; None when there is nothing to summarise (JSON has no NaN)."""
    if not values:
        return dict.fromkeys(STATS)
    summary: dict[str, float | None] = {"mean": sum(values) / len(values)}
    for stat in STATS[1:]:
        summary[stat] = percentile(values, float(stat[1:]))
    return summary


@dataclass(frozen=True, slots=True)
class SloTarget:
    metric: str  # ttft | tpot | itl | e2e
    stat: str  # mean | p50 | ... | p99
    threshold_ms: float

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"

    def per_request_ms(self, result: RequestResult) -> list[float]:
        """The values of one request that must each stay under the threshold for it to count toward goodput."""
        if self.metric == "ttft":
            return [] if result.ttft_s is None else [result.ttft_s * 1000]
        if self.metric == "tpot":
            return [] if result.tpot_s is None else [result.tpot_s * 1000]
        if self.metric == "e2e":
            return [result.e2e_s * 1000]
        return [max(result.itl_s) * 1000] if result.itl_s else []


_SLO_RE = re.compile(r"^(ttft|tpot|itl|e2e)_(mean|p50|p90|p95|p99)=([0-9]*\.?[0-9]+)(us|ms|s)?$")


def parse_slo(spec: str | None) -> list[SloTarget]:
    """`ttft_p95=500ms,tpot_p95=50ms` (units us/ms/s; a bare number is milliseconds)."""
    if not spec:
        return []
    targets = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        match = _SLO_RE.match(part.lower())
        if match is None:
            raise ValueError(
                f"cannot read SLO {part!r}: use METRIC_STAT=VALUE[us|ms|s] with METRIC in {', '.join(METRICS)} "
                f"and STAT in {', '.join(STATS)}, e.g. ttft_p95=500ms,tpot_p95=50ms"
            )
        metric, stat, value, unit = match.groups()
        targets.append(SloTarget(metric, stat, float(value) * _UNITS_MS[unit or "ms"]))
    return targets


def _ms(values: list[float | None]) -> list[float]:
    return [v * 1000 for v in values if v is not None]


def level_figures(run: LevelRun, slo: list[SloTarget]) -> dict[str, Any]:
    """One entry of the JSON `levels` list."""
    ok = [r for r in run.results if r.is_ok]
    errors = Counter(r.error_code for r in run.results if r.error_code is not None)
    wall = run.wall_s or math.nan
    num_output = sum(r.num_output_tokens for r in ok)
    num_prompt = sum(r.num_prompt_tokens or 0 for r in ok)
    num_good = sum(1 for r in ok if all(v <= t.threshold_ms for t in slo for v in t.per_request_ms(r)))
    figures: dict[str, Any] = {"concurrency": run.spec.concurrency} if run.spec.concurrency is not None else {}
    if run.spec.rate is not None:
        figures["rate"] = run.spec.rate
    figures |= {
        "requests": len(run.results),
        "successful": len(ok),
        "errors": dict(sorted(errors.items())),
        "warmup_requests": run.num_warmup,
        "dropped": run.num_dropped,
        "duration_s": run.wall_s,
        "request_throughput": _rate(len(ok), wall),
        "output_throughput": _rate(num_output, wall),
        "total_throughput": _rate(num_output + num_prompt, wall),
        "goodput": _rate(num_good, wall) if slo else None,
        "input_tokens_mean": num_prompt / len(ok) if ok else None,
        "output_tokens_mean": num_output / len(ok) if ok else None,
        "is_usage_reported": all(r.is_usage_reported for r in ok) if ok else None,
        "ttft_ms": summarize(_ms([r.ttft_s for r in ok])),
        "tpot_ms": summarize(_ms([r.tpot_s for r in ok])),
        "itl_ms": summarize(_ms([gap for r in ok for gap in r.itl_s])),
        "e2e_ms": summarize(_ms([r.e2e_s for r in ok])),
        "client_cpu_utilization": run.cpu_utilization,
        "client_max_schedule_lag_ms": run.max_schedule_lag_s * 1000,
    }
    return figures


def _rate(count: float, wall_s: float) -> float:
    return 0.0 if not count or math.isnan(wall_s) or wall_s <= 0 else count / wall_s


def breaches(level: dict[str, Any], slo: list[SloTarget]) -> list[dict[str, Any]]:
    """The SLO targets a level misses; a level where every request failed misses all of them."""
    missed = []
    for target in slo:
        value = level[f"{target.metric}_ms"][target.stat]
        if value is None or value > target.threshold_ms:
            missed.append({"metric": target.name, "value_ms": value, "threshold_ms": target.threshold_ms})
    return missed


def slo_result(levels: list[dict[str, Any]], slo: list[SloTarget]) -> dict[str, Any]:
    """The highest load level below the first one that misses the SLO (levels in increasing load order)."""
    key = "concurrency" if levels and "concurrency" in levels[0] else "rate"
    result: dict[str, Any] = {
        "slo": {t.name: t.threshold_ms for t in slo},
        "max_concurrency_meeting_slo": None,
        "max_rate_meeting_slo": None,
        "first_failing": None,
        "breached": [],
    }
    if not slo:
        return result
    best = None
    for level in sorted(levels, key=lambda lv: lv[key]):
        missed = breaches(level, slo)
        if missed:
            result["first_failing"] = level[key]
            result["breached"] = missed
            break
        best = level[key]
    result[f"max_{key}_meeting_slo"] = best
    return result


def find_saturation(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The level after which more load stops buying throughput: no higher level reaches 10% more output tokens/s
    (a plateau followed by growth, e.g. a noisy level, is not saturation); None if the last level still grows."""
    if not levels:
        return None
    key = "concurrency" if "concurrency" in levels[0] else "rate"
    ordered = sorted(levels, key=lambda lv: lv[key])
    for index, level in enumerate(ordered[:-1]):
        best_after = max(later["output_throughput"] for later in ordered[index + 1 :])
        if best_after < level["output_throughput"] * (1 + SATURATION_GROWTH):
            return {key: level[key], "output_throughput": level["output_throughput"]}
    return None
