"""One bench run: probe the server, run every level with telemetry around it, and assemble the run document.

The document is the contract scripts depend on: top-level `config`, `environment`, `levels` (one object per
level), `slo_result`, plus `saturation` and `warnings`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from rich.console import Console

from bench.client import BenchClient
from bench.loadgen import LevelSpec, run_level
from bench.report import LiveProgress
from bench.stats import SloTarget, find_saturation, level_figures, slo_result
from bench.telemetry import GpuSampler, metrics_delta, scrape_metrics, speculative_acceptance
from bench.workload import Workload

__all__ = ["SCHEMA_VERSION", "BenchConfig", "BenchError", "run_bench"]

SCHEMA_VERSION = 1
CPU_SATURATED = 0.9  # one asyncio process cannot use more than one core
MAX_SCHEDULE_LAG_S = 0.05


class BenchError(Exception):
    """The run cannot start (e.g. the server rejects the probe request); the message says what to do."""


@dataclass(slots=True)
class BenchConfig:
    base_url: str
    api_key: str
    model: str
    concurrency: list[int] = field(default_factory=lambda: [1])
    rate: list[float] = field(default_factory=list)  # open loop when non-empty
    duration_s: float | None = 30.0
    warmup_s: float = 5.0
    max_requests: int | None = None
    timeout_s: float = 600.0
    max_in_flight: int = 1024
    seed: int = 0
    workload: dict[str, Any] = field(default_factory=dict)  # the Workload's description
    slo: str | None = None
    tokenizer: str | None = None
    is_telemetry_enabled: bool = True

    def level_specs(self) -> list[LevelSpec]:
        level = functools.partial(
            LevelSpec, warmup_s=self.warmup_s, duration_s=self.duration_s, max_requests=self.max_requests
        )
        if self.rate:
            return [
                level(rate=r, max_in_flight=self.max_in_flight, seed=self.seed + i)
                for i, r in enumerate(sorted(self.rate))
            ]
        return [level(concurrency=c) for c in sorted(self.concurrency)]

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self)
        del config["api_key"]  # a baseline archive must never hold a secret
        config["mode"] = "rate" if self.rate else "concurrency"
        return config


def _git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(server: dict[str, Any], config: BenchConfig, probe: dict[str, Any], started_at: str) -> dict[str, Any]:
    entry = server.get("model_entry") or {}
    return {
        "target": config.base_url,
        "model": config.model,
        "server": server,
        "quantization": entry.get("quantization"),
        "dtype": entry.get("dtype"),
        "max_model_len": entry.get("max_model_len"),
        "request_options": probe,
        "git_revision": _git_revision(),
        "unigate_version": _version("unigate"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "num_cpus": os.cpu_count(),
        "started_at": started_at,
        "client_event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],  # uvloop | asyncio
    }


def _warnings(levels: list[dict[str, Any]], probe: dict[str, Any]) -> list[str]:
    notes = []
    if not probe["ignore_eos"]:
        notes.append("the server rejected ignore_eos: answers may stop early, so output lengths are not controlled")
    for level in levels:
        label = f"concurrency {level['concurrency']}" if "concurrency" in level else f"rate {level['rate']:g}/s"
        if level["client_cpu_utilization"] >= CPU_SATURATED:
            notes.append(
                f"the bench client used {level['client_cpu_utilization']:.0%} of a CPU core at {label}: the figures "
                "may measure the client, not the server; run it on a separate machine or lower the load"
            )
        if level["client_max_schedule_lag_ms"] > MAX_SCHEDULE_LAG_S * 1000:
            notes.append(
                f"at {label} the client started requests up to {level['client_max_schedule_lag_ms']:.0f} ms "
                "late: the offered rate was not fully met"
            )
        if level["dropped"]:
            notes.append(f"at {label} {level['dropped']} arrivals were dropped: more than --max-in-flight in flight")
        if level["is_usage_reported"] is False:
            notes.append(f"at {label} the server sent no usage: output tokens were counted from streamed chunks")
    return notes


async def run_bench(config: BenchConfig, workload: Workload, slo: list[SloTarget], console: Console) -> dict[str, Any]:
    specs = config.level_specs()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    max_connections = max(config.concurrency) if not config.rate else config.max_in_flight
    async with BenchClient(
        config.base_url, config.api_key, config.model, max_connections=max_connections, timeout_s=config.timeout_s
    ) as client:
        probe = await client.probe()
        if not probe.is_ok:
            raise BenchError(
                f"the server rejected a one-line test request: {probe.message}. "
                f"Run `unigate doctor --base-url {config.base_url} --model {config.model}` to find out why."
            )
        probe_info = {"ignore_eos": probe.is_ignore_eos_sent, "stream_options_include_usage": probe.is_usage_requested}
        server = await client.server_info()
        requests = iter(workload)  # one stream for the whole run, so no level replays a previous level's prompts
        progress = LiveProgress(console)
        gpu = GpuSampler()
        levels = []
        for spec in specs:
            before = await scrape_metrics(client.http, config.base_url) if config.is_telemetry_enabled else None
            gpu.start()
            progress.start_level(spec.label)
            run = await run_level(client, requests, spec, progress.on_result)
            progress.end_level()
            gpu_figures = await gpu.stop()
            after = await scrape_metrics(client.http, config.base_url) if config.is_telemetry_enabled else None
            figures = level_figures(run, slo)
            figures["telemetry"] = {"metrics": metrics_delta(before, after), "gpu": gpu_figures}
            levels.append(figures)
    env = environment(server, config, probe_info, started_at)
    env["speculative"] = speculative_acceptance(levels)  # the server's, when its /metrics exports it
    return {
        "schema_version": SCHEMA_VERSION,
        "config": config.to_dict(),
        "environment": env,
        "levels": levels,
        "slo_result": slo_result(levels, slo),
        "saturation": find_saturation(levels),
        "warnings": _warnings(levels, probe_info),
        "finished_at_unix": time.time(),
    }
