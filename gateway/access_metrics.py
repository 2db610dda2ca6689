"""Access-control counters for `/metrics`, read from the access object at scrape time (no hot-path cost)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from auth.base import AccessStats

__all__ = ["AccessStatsCollector"]


class AccessStatsCollector(Collector):
    """`unigate_redis_script_errors_total{script}`, `unigate_redis_storage_errors_total` and
    `unigate_limit_bypasses_total` of an access control that keeps them (the Redis-backed one)."""

    def __init__(self, access: object) -> None:
        self._access = access if isinstance(access, AccessStats) else None

    def collect(self) -> Iterator[Metric]:
        access = self._access
        if access is None:
            return
        script_errors = CounterMetricFamily(
            "unigate_redis_script_errors",
            "Lua script errors (bugs of the gateway, never counted as Redis outages), by script.",
            labels=["script"],
        )
        for script, count in sorted(access.num_script_errors.items()):
            script_errors.add_metric([script], count)
        yield script_errors
        yield CounterMetricFamily(
            "unigate_redis_storage_errors",
            "Redis calls that failed for the store itself (unreachable, timed out, read-only, out of memory).",
            value=access.num_storage_errors,
        )
        yield CounterMetricFamily(
            "unigate_limit_bypasses",
            "Requests served without checking their limits because Redis was unavailable (failure mode).",
            value=access.num_limit_bypasses,
        )
