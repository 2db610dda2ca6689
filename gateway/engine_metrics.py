"""Local-engine stats for `/metrics` and `GET /admin/engine`, read from each engine at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.base import ReportsEngineStats
from gateway.router import Router

__all__ = ["EngineStatsCollector", "fold_tenants", "local_engine_stats"]

MAX_TENANT_LABELS = 16  # tenants beyond the most served ones are summed under "other" (bounded label sets)
# per-tenant stat key -> (metric name without _total, help); counters labelled by tenant
_TENANT_COUNTERS = {
    "served_tokens": ("unigate_engine_tenant_tokens", "Tokens the engine computed for each tenant (prefill+decode)."),
    "queue_time_s": ("unigate_engine_tenant_queue_seconds", "Seconds the tenant's sequences waited for admission."),
    "preemptions": ("unigate_engine_tenant_preemptions", "The tenant's sequences preempted (recompute)."),
}

# stat key -> (metric name, help); gauges
_GAUGES = {
    "num_running_seqs": ("unigate_engine_running_seqs", "Sequences being decoded or prefilled."),
    "num_waiting_seqs": ("unigate_engine_waiting_seqs", "Sequences queued for a slot."),
    "num_preempted_seqs": ("unigate_engine_preempted_seqs", "Waiting sequences that were preempted (recompute)."),
    "kv_blocks_total": ("unigate_engine_kv_blocks_total", "KV cache blocks."),
    "kv_blocks_used": ("unigate_engine_kv_blocks_used", "KV cache blocks in use."),
    "kv_blocks_free": ("unigate_engine_kv_blocks_free", "KV cache blocks free."),
    "kv_utilization": ("unigate_engine_kv_utilization", "Tokens stored / token slots allocated."),
    "prefix_cache_hit_rate": ("unigate_engine_prefix_cache_hit_rate", "Share of prompt tokens served from cache."),
    "prompt_tokens_per_s": ("unigate_engine_prompt_tokens_per_second", "Recent prefill throughput."),
    "generation_tokens_per_s": ("unigate_engine_generation_tokens_per_second", "Recent decode throughput."),
}
# stat key -> (metric name without _total, help); counters
_COUNTERS = {
    "num_preemptions_total": ("unigate_engine_preemptions", "Preemptions since start."),
    "prompt_tokens_total": ("unigate_engine_prompt_tokens", "Prompt tokens computed since start."),
    "generation_tokens_total": ("unigate_engine_generation_tokens", "Tokens generated since start."),
    "spec_proposed_tokens_total": ("unigate_engine_spec_proposed_tokens", "Speculative tokens proposed."),
    "spec_accepted_tokens_total": ("unigate_engine_spec_accepted_tokens", "Speculative tokens accepted."),
}


def local_engine_stats(router: Router | None) -> list[dict[str, Any]]:
    """`stats()` of every deployment whose backend reports them (the local engines), with its public model id."""
    if router is None:
        return []
    result = []
    for deployment in router.deployments:
        if isinstance(deployment.backend, ReportsEngineStats):
            result.append({"model": deployment.config.id, **deployment.backend.stats()})
    return result


class EngineStatsCollector(Collector):
    """Prometheus collector over the app's router (set once the lifespan has built it)."""

    def __init__(self) -> None:
        self.router: Router | None = None

    def describe(self) -> list[Metric]:
        return []  # collected on demand: the engines do not exist yet when the collector is registered

    def collect(self) -> Iterator[Metric]:
        engines = [s for s in local_engine_stats(self.router) if s.get("loaded")]
        labels = ["model", "deployment"]
        loaded = GaugeMetricFamily("unigate_engine_loaded", "1 once the model is loaded.", labels=labels)
        for stats in local_engine_stats(self.router):
            loaded.add_metric([stats["model"], stats["name"]], 1.0 if stats.get("loaded") else 0.0)
        yield loaded
        for key, (name, help_text) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            for stats in engines:
                if isinstance(stats.get(key), int | float):
                    gauge.add_metric([stats["model"], stats["name"]], float(stats[key]))
            yield gauge
        for key, (name, help_text) in _COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=labels)
            for stats in engines:
                if isinstance(stats.get(key), int | float):
                    counter.add_metric([stats["model"], stats["name"]], float(stats[key]))
            yield counter
        memory = GaugeMetricFamily(
            "unigate_engine_memory_bytes", "Engine memory: weights, kv_cache, peak.", labels=[*labels, "kind"]
        )
        for stats in engines:
            for kind, value in (stats.get("memory_bytes") or {}).items():
                if isinstance(value, int | float):
                    memory.add_metric([stats["model"], stats["name"], kind], float(value))
        yield memory
        yield from _tenant_counters(engines, labels)


def fold_tenants(tenants: dict[str, dict[str, float]], cap: int = MAX_TENANT_LABELS) -> dict[str, dict[str, float]]:
    """The `cap` most served tenants as they are, the rest summed under "other"."""
    ranked = sorted(tenants, key=lambda t: -tenants[t].get("served_tokens", 0.0))
    folded = {(t or "anonymous"): dict(tenants[t]) for t in ranked[:cap]}
    for tenant in ranked[cap:]:
        other = folded.setdefault("other", {})
        for key, value in tenants[tenant].items():
            other[key] = other.get(key, 0.0) + value
    return folded


def _tenant_counters(engines: list[dict[str, Any]], labels: list[str]) -> Iterator[Metric]:
    for key, (name, help_text) in _TENANT_COUNTERS.items():
        counter = CounterMetricFamily(name, help_text, labels=[*labels, "tenant"])
        for stats in engines:
            for tenant, values in fold_tenants(stats.get("tenants") or {}).items():
                counter.add_metric([stats["model"], stats["name"], tenant], float(values.get(key, 0.0)))
        yield counter
