"""Server-side telemetry around each level: Prometheus /metrics before and after, nvidia-smi sampling during.

Only the series that explain a latency change are kept (KV-cache usage, preemptions, queue lengths, running
requests) — ours (`unigate_*`) and vLLM's (`vllm:*`) alike. Anything missing is recorded as "not available";
a /metrics page without any such series as `NONE_EXPORTED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.client import server_root

__all__ = [
    "NONE_EXPORTED",
    "NOT_AVAILABLE",
    "GpuSampler",
    "interesting_samples",
    "metrics_delta",
    "scrape_metrics",
    "speculative_acceptance",
]

NOT_AVAILABLE = "not available"
NONE_EXPORTED = "none exported: the target's /metrics has no KV-cache, queue, preemption or running-request series"
_INTERESTING = (
    "kv",
    "cache_usage",
    "preempt",
    "queue",
    "waiting",
    "running",
    "swapped",
    "num_requests",
    "prefix",
    "spec",
)


def interesting_samples(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, for the series that explain latency; histogram buckets dropped."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith(("_bucket", "_created")) or not any(word in name.lower() for word in _INTERESTING):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("le", "quantile"))
            samples[f"{name}{{{labels}}}" if labels else name] = float(sample.value)
    return samples


async def scrape_metrics(http: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    try:
        response = await http.get(f"{server_root(base_url)}/metrics", timeout=5.0)
        if response.status_code != 200:
            return None
        return interesting_samples(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | str:
    if before is None or after is None:
        return NOT_AVAILABLE
    if not before and not after:
        return NONE_EXPORTED
    return {
        name: {"before": before.get(name), "after": value, "delta": value - before.get(name, 0.0)}
        for name, value in sorted(after.items())
    }


def speculative_acceptance(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The server's speculative-decoding acceptance over the run, from each level's /metrics deltas: proposed
    (unigate's `*_spec_proposed_tokens_total`, vLLM's `*spec_decode_num_draft_tokens*`) and accepted tokens summed
    over the levels, and their ratio. None when the server exports no such counter or nothing was proposed."""
    proposed = accepted = 0.0
    for level in levels:
        metrics = level.get("telemetry", {}).get("metrics")
        if not isinstance(metrics, dict):
            continue
        for name, values in metrics.items():
            lowered = name.lower()
            if "spec" not in lowered or lowered.endswith("_created"):
                continue
            if "proposed" in lowered or "draft_tokens" in lowered:
                proposed += values["delta"]
            elif "accepted" in lowered:
                accepted += values["delta"]
    if proposed <= 0:
        return None
    return {"proposed": int(proposed), "accepted": int(accepted), "acceptance_rate": accepted / proposed}


class GpuSampler:
    """Samples `nvidia-smi` once a second while a level runs: peak memory and utilisation per GPU."""

    _QUERY = "--query-gpu=index,memory.used,memory.total,utilization.gpu"

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.is_available = shutil.which("nvidia-smi") is not None
        self._samples: list[list[float]] = []
        self._task: asyncio.Task[None] | None = None

    async def _sample_once(self) -> None:
        process = await asyncio.create_subprocess_exec(
            "nvidia-smi",
            self._QUERY,
            "--format=csv,noheader,nounits",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        stdout, _ = await process.communicate()
        for line in stdout.decode().splitlines():
            with contextlib.suppress(ValueError):
                self._samples.append([float(x) for x in line.split(",")])

    async def _loop(self) -> None:
        while True:
            await self._sample_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._samples = []
        if self.is_available:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> dict[str, Any] | str:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await self._task
            self._task = None
        if not self._samples:
            return NOT_AVAILABLE
        gpus: dict[str, Any] = {}
        for index in sorted({int(s[0]) for s in self._samples}):
            rows = [s for s in self._samples if int(s[0]) == index]
            gpus[str(index)] = {
                "memory_used_peak_mib": max(r[1] for r in rows),
                "memory_total_mib": rows[0][2],
                "utilization_mean_pct": sum(r[3] for r in rows) / len(rows),
                "utilization_max_pct": max(r[3] for r in rows),
                "num_samples": len(rows),
            }
        return gpus
