"""Prometheus metrics on a per-app `CollectorRegistry` (several apps in one process do not clash).

With `--workers N` each worker exposes its own figures; scrape each or run one worker per container.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "unigate_requests",
            "Requests answered, by public model, route and HTTP status.",
            ["model", "route", "status"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "unigate_request_duration_seconds",
            "Time from request start to the end of the response (whole stream for SSE).",
            ["model", "route", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "unigate_time_to_first_token_seconds",
            "Streaming: time from request start to the first chunk sent to the client.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "unigate_upstream_duration_seconds",
            "One upstream attempt: until the full response (non-streaming) or the first chunk (streaming).",
            ["deployment", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "unigate_tokens",
            "Tokens by public model and direction (in = prompt, out = completion).",
            ["model", "direction"],
            registry=self.registry,
        )
        self.errors = Counter(
            "unigate_errors", "Error responses and stream errors by code.", ["code"], registry=self.registry
        )
        self.in_flight = Gauge("unigate_requests_in_flight", "Requests being served now.", registry=self.registry)
        # Labelled children by label values: `labels()` costs about a microsecond per call on the hot path. The
        # label sets are the ones prometheus keeps anyway, so these caches grow exactly as the registry does.
        self._request_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._upstream_children: dict[tuple[str, str], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}

    def observe_request(self, model: str, route: str, status: str, seconds: float) -> None:
        key = (model, route, status)
        children = self._request_children.get(key)
        if children is None:
            children = self._request_children[key] = (self.requests.labels(*key), self.request_latency.labels(*key))
        children[0].inc()
        children[1].observe(seconds)

    def observe_upstream(self, deployment: str, outcome: str, seconds: float) -> None:
        key = (deployment, outcome)
        child = self._upstream_children.get(key)
        if child is None:
            child = self._upstream_children[key] = self.upstream_latency.labels(*key)
        child.observe(seconds)

    def count_tokens(self, model: str, num_in: int, num_out: int) -> None:
        children = self._token_children.get(model)
        if children is None:
            children = self._token_children[model] = (self.tokens.labels(model, "in"), self.tokens.labels(model, "out"))
        children[0].inc(num_in)
        children[1].inc(num_out)

    def render(self) -> bytes:
        return generate_latest(self.registry)
