"""Prometheus metrics on a per-app `CollectorRegistry` (several apps in one process do not clash).

With `--workers N` each worker exposes its own figures; scrape each or run one worker per container.

Label values never come straight from callers or upstreams, so the exposition cannot grow without bound:
`model` is a configured model id (a wildcard-expanded name such as `openai/gpt-x` counts under its pattern,
`openai/*`; anything else under `other`), `code` is one of `KNOWN_ERROR_CODES` (else `other`), `route` is a
route template, `deployment` a configured deployment name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.slo_admission import slo_states

__all__ = ["CONTENT_TYPE", "KNOWN_ERROR_CODES", "OTHER", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OTHER = "other"  # the bucket for label values outside the known set

# Every `code` the gateway, access control, backends and the engine raise (a test keeps this in step with the
# source). Codes an upstream sends in its own error body are counted as `other`.
KNOWN_ERROR_CODES = frozenset(
    {
        "admin_only",
        "body_too_large",
        "budget_exceeded",
        "chat_template_missing",
        "checkpoint_corrupt",
        "checkpoint_not_found",
        "checkpoint_unsupported",
        "client_disconnected",
        "concurrency_limit_exceeded",
        "context_length_exceeded",
        "csrf_failed",
        "engine_error",
        "engine_loading",
        "headers_too_large",
        "internal_error",
        "invalid_api_key",
        "invalid_auth_header",
        "invalid_json",
        "invalid_messages",
        "invalid_request",
        "key_expired",
        "key_not_found",
        "key_revoked",
        "limits_unavailable",
        "method_not_allowed",
        "metrics_forbidden",
        "missing_api_key",
        "model_not_allowed",
        "model_not_found",
        "model_not_installed",
        "not_found",
        "overloaded",
        "permission_denied",
        "rate_limit_exceeded",
        "request_not_found",
        "server_shutting_down",
        "service_unavailable",
        "session_expired",
        "storage_unavailable",
        "team_has_keys",
        "team_not_found",
        "tokenizer_not_found",
        "tokens_limit_exceeded",
        "unsupported_endpoint",
        "unsupported_parameter",
        "upstream_at_capacity",
        "upstream_auth_failed",
        "upstream_cooling_down",
        "upstream_error",
        "upstream_malformed_response",
        "upstream_overloaded",
        "upstream_rate_limited",
        "upstream_timeout",
        "upstream_unreachable",
    }
)

# SLO-aware admission, per deployment of a model with `slo` (gateway/slo_admission.py): state key -> (name, help)
_SLO_GAUGES = {
    "limit": ("unigate_slo_limit", "The live limit on requests in flight that keeps the deployment within its SLO."),
    "num_in_flight": ("unigate_slo_in_flight", "Requests admitted under that limit and not finished."),
    "num_queued": ("unigate_slo_queued", "Requests waiting for a place under the limit."),
    "ttft_p50_ms": ("unigate_slo_ttft_p50_ms", "TTFT p50 over the deployment's recent requests (ms)."),
    "ttft_p95_ms": ("unigate_slo_ttft_p95_ms", "TTFT p95 over the deployment's recent requests (ms)."),
    "tpot_p50_ms": ("unigate_slo_tpot_p50_ms", "TPOT p50 over the deployment's recent streams (ms)."),
    "tpot_p95_ms": ("unigate_slo_tpot_p95_ms", "TPOT p95 over the deployment's recent streams (ms)."),
}

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _BoundedLabel:
    """A one-label metric whose `labels(value)` maps the value into a bounded set first."""

    def __init__(self, metric: Any, bound: Any) -> None:
        self._metric = metric
        self._bound = bound

    def labels(self, value: str) -> Any:
        return self._metric.labels(self._bound(value))


class GatewayMetrics:
    def __init__(self, model_ids: Iterable[str] | None = None) -> None:
        """`model_ids`: the routing table's model ids (wildcards end in `*`); until given (`bind_models`), every
        non-empty model label is `other`."""
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
        ttft = Histogram(
            "unigate_time_to_first_token_seconds",
            "Streaming: time from request start to the first chunk sent to the client.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = _BoundedLabel(ttft, self.model_label)
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
        errors = Counter(
            "unigate_errors", "Error responses and stream errors by code.", ["code"], registry=self.registry
        )
        self.errors = _BoundedLabel(errors, error_label)
        self.in_flight = Gauge("unigate_requests_in_flight", "Requests being served now.", registry=self.registry)
        # Labelled children by label values: `labels()` costs about a microsecond per call on the hot path. The
        # keys are bounded label values, so these caches grow exactly as the registry does.
        self._request_children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._upstream_children: dict[tuple[str, str], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}
        self._model_labels: dict[str, str] | None = None
        self._wildcards: list[str] = []
        self._slo = _SloCollector()
        self.registry.register(self._slo)
        if model_ids is not None:
            self.bind_models(model_ids)

    def watch_slo(self, routes: Iterable[Any]) -> None:
        """The router's routes, whose SLO admission state the gauges read at scrape time (once the router exists)."""
        self._slo.routes = routes

    @property
    def has_models(self) -> bool:
        return self._model_labels is not None

    def bind_models(self, model_ids: Iterable[str]) -> None:
        """The configured model ids: the only `model` label values besides wildcard patterns and `other`."""
        ids = list(model_ids)
        self._model_labels = {model_id: model_id for model_id in ids if not model_id.endswith("*")}
        self._model_labels[""] = ""  # requests that name no model (health, admin, metrics)
        self._wildcards = sorted((i for i in ids if i.endswith("*")), key=len, reverse=True)

    def model_label(self, model: str) -> str:
        labels = self._model_labels
        if labels is None:
            return model and OTHER
        label = labels.get(model)
        if label is not None:
            return label
        label = next((w for w in self._wildcards if model.startswith(w[:-1]) and len(model) >= len(w)), OTHER)
        if len(labels) < _MAX_REMEMBERED_MODELS:
            labels[model] = label  # remembered to skip the scan; the label set itself stays bounded
        return label

    def observe_request(self, model: str, route: str, status: str, seconds: float) -> None:
        key = (self.model_label(model), route, status)
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
        label = self.model_label(model)
        children = self._token_children.get(label)
        if children is None:
            children = self._token_children[label] = (self.tokens.labels(label, "in"), self.tokens.labels(label, "out"))
        children[0].inc(num_in)
        children[1].inc(num_out)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_MAX_REMEMBERED_MODELS = 4096


class _SloCollector(Collector):
    """The `unigate_slo_*` gauges, labelled by model and deployment (configured names only)."""

    def __init__(self) -> None:
        self.routes: Iterable[Any] = ()

    def describe(self) -> list[Metric]:
        return []  # collected on demand: the router does not exist yet when the registry is built

    def collect(self) -> Iterator[Metric]:
        rows = list(slo_states(self.routes))
        if not rows:
            return
        for key, (name, help_text) in _SLO_GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=["model", "deployment"])
            for model, deployment, state in rows:
                value = state.get(key)
                if isinstance(value, int | float):
                    gauge.add_metric([model, deployment], float(value))
            yield gauge


def error_label(code: str) -> str:
    return code if code in KNOWN_ERROR_CODES else OTHER
