"""OpenTelemetry traces, off unless the standard `OTEL_*` variables ask for them.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Everything else is the SDK's own reading of the
environment: `OTEL_SERVICE_NAME` (default here: "unigate"), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` /
`OTEL_TRACES_SAMPLER_ARG`, `OTEL_EXPORTER_OTLP_HEADERS`, timeouts. Spans go out over OTLP/HTTP (protobuf) in
batches from a background thread. `opentelemetry-sdk` and the exporter are the optional extra `unigate[otel]`
(`make run` installs it); configured without it, the gateway says so once and serves without traces.

The spans of a request are opened by its trace (gateway/request_trace.py); this module only builds the tracer and
moves context in and out of W3C `traceparent` headers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, Tracer

__all__ = ["Tracing", "tracing_from_env"]

logger = logging.getLogger("unigate.tracing")


def _is_requested(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def tracing_from_env(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The gateway's tracing as the environment configures it, or None (off, or the SDK is not installed)."""
    environ = os.environ if environ is None else environ
    if not _is_requested(environ):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: serving without traces "
            "(pip install 'unigate[otel]')"
        )
        return None
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": "unigate"}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider)


class Tracing:
    """One tracer provider per app (never the global one: several apps may live in one process)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer: Tracer = provider.get_tracer("unigate")
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = set_span_in_context
        self.server_kind: SpanKind = SpanKind.SERVER
        self.client_kind: SpanKind = SpanKind.CLIENT
        self.internal_kind: SpanKind = SpanKind.INTERNAL

    def start_request(self, headers: Iterable[tuple[bytes, bytes]], name: str, start_ns: int) -> Span | None:
        """The request's root span, continuing the client's `traceparent` when it sent a valid one; None when the
        sampler leaves this trace out (then no child span is made either: an unsampled request costs ~nothing)."""
        carrier = {}
        for key, value in headers:
            if key in (b"traceparent", b"tracestate"):
                carrier[key.decode("latin-1")] = value.decode("latin-1")
        context = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(name, context=context, kind=self.server_kind, start_time=start_ns)
        return span if span.is_recording() else None

    def start_child(
        self, parent: Span, name: str, *, start_ns: int, kind: SpanKind | None = None, attributes: Any = None
    ) -> Span:
        return self._tracer.start_span(
            name,
            context=self._in_context(parent),
            kind=kind if kind is not None else self.internal_kind,
            start_time=start_ns,
            attributes=attributes,
        )

    def headers_for(self, span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span` as the parent, for a call to an upstream."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter's thread."""
        self._provider.shutdown()
