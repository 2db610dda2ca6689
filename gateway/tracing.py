"""OpenTelemetry traces, off unless the standard `OTEL_*` variables ask for them.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Read as the specification says: `OTEL_SERVICE_NAME`
(default here: "unigate") and `OTEL_RESOURCE_ATTRIBUTES` (the SDK's `Resource`), `OTEL_TRACES_SAMPLER` /
`OTEL_TRACES_SAMPLER_ARG` (the six standard samplers; default `parentbased_always_on`), `OTEL_BSP_SCHEDULE_DELAY`
(ms), `OTEL_BSP_MAX_QUEUE_SIZE` and `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (spans), and the OTLP exporter's own
`OTEL_EXPORTER_OTLP_*` headers, timeout, compression and certificates.

Why not the SDK's tracer: a request makes six or seven spans, and the SDK's spans (locks, bounded attribute maps,
processor hooks) and its protobuf encoder cost ~260 µs of CPU per request, two thirds of what the gateway spends
on the request itself. Here a span is a small record (`otlp_encoding.EncodedSpan`) appended to its request's list;
when the request's root span ends the list is queued, and a background thread writes batches of them to the wire
format directly (gateway/otlp_encoding.py) and sends them with the SDK's own OTLP/HTTP exporter client (its
retries, headers, compression and TLS), so what reaches the collector is standard OTLP/HTTP protobuf. A request the
sampler leaves out makes no span at all (~2 µs).

The spans of a request are opened by its trace (gateway/request_trace.py); this module makes them, samples,
exports, and moves context in and out of W3C `traceparent` headers.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.otlp_encoding import EncodedSpan, encode_attributes, encode_request

__all__ = ["Sampler", "Span", "Tracing", "parse_traceparent", "tracing_from_env"]

logger = logging.getLogger("unigate.tracing")

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_TRACESTATE = 512
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)


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
    except ImportError:
        logger.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: serving without traces "
            "(pip install 'unigate[otel]')"
        )
        return None
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": "unigate"}
    resource = Resource.create(attributes)
    exporter = OTLPSpanExporter()

    def send(data: bytes) -> bool:
        # The exporter's client takes an encoded body (opentelemetry-exporter-otlp-proto-http 1.45, pinned by the
        # `otel` extra); `export()` would take the SDK's span objects, which these are not.
        return bool(exporter._client.export(data).success)

    batches = BatchExporter(
        send,
        encode_attributes(dict(resource.attributes)),
        close=exporter.shutdown,
        delay_s=_env_number(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
        max_queue_spans=int(_env_number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)),
        batch_spans=int(_env_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
    )
    return Tracing(batches, Sampler.from_env(environ))


def _env_number(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        value = float(environ.get(name, default))
    except ValueError:
        logger.warning("%s=%r is not a number: using %s", name, environ.get(name), default)
        return default
    return value if value > 0 else default


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid W3C `traceparent`; None for anything else."""
    match = _TRACEPARENT.fullmatch(value.strip().lower())
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)


@dataclass(frozen=True, slots=True)
class Sampler:
    """The specification's samplers: `root` decides for a request without a parent (always_on, always_off, or a
    trace id ratio); `parent_based` follows a client's `traceparent` sampled flag when there is one."""

    parent_based: bool = True
    ratio: float = 1.0  # 1.0: always_on; 0.0: always_off

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Sampler:
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        if name not in _SAMPLERS:
            logger.warning("OTEL_TRACES_SAMPLER=%r is not one of %s: using parentbased_always_on", name, _SAMPLERS)
            name = "parentbased_always_on"
        ratio = 1.0 if name.endswith("always_on") else 0.0 if name.endswith("always_off") else 1.0
        if name.endswith("traceidratio"):
            try:
                ratio = min(max(float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")), 0.0), 1.0)
            except ValueError:
                logger.warning("OTEL_TRACES_SAMPLER_ARG is not a number: sampling every trace")
        return cls(parent_based=name.startswith("parentbased_"), ratio=ratio)

    def is_sampled(self, trace_id: int, parent_sampled: bool | None) -> bool:
        if self.parent_based and parent_sampled is not None:
            return parent_sampled
        # The SDK's TraceIdRatioBased rule: the trace id's low 64 bits under ratio × 2^64.
        return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < round(self.ratio * (1 << 64))


@dataclass(slots=True)
class _Trace:
    trace_id: int
    trace_state: str
    spans: list[EncodedSpan] = field(default_factory=list)


class Span:
    """One span of a request: attributes, a name, an error, and its end. Its record goes out with the request's
    root span."""

    __slots__ = ("_exporter", "record", "trace")

    def __init__(self, trace: _Trace, record: EncodedSpan, exporter: BatchExporter | None) -> None:
        self.trace, self.record, self._exporter = trace, record, exporter  # exporter: the root's only
        trace.spans.append(record)

    @property
    def span_id(self) -> int:
        return self.record.span_id

    def set_attribute(self, key: str, value: str | bool | int | float) -> None:
        self.record.attributes.append((key, value))

    def update_name(self, name: str) -> None:
        self.record.name = name

    def set_error(self, error_type: str) -> None:
        self.record.error_type = error_type
        self.record.attributes.append(("error.type", error_type))

    def end(self, end_time: int | None = None) -> None:
        """End it (now, or at `end_time` ns since the epoch); ending the root sends the request's spans. Only the
        first end counts."""
        if self.record.end_ns:
            return
        self.record.end_ns = end_time if end_time is not None else time.time_ns()
        if self._exporter is not None:
            for span in self.trace.spans:  # a child left open ends with its request
                if not span.end_ns:
                    span.end_ns = self.record.end_ns
            self._exporter.submit(self.trace)


class Tracing:
    """Spans for one app's requests, exported in batches (never the process-wide tracer: several apps may live in
    one process)."""

    server_kind = 2
    client_kind = 3
    internal_kind = 1

    def __init__(self, exporter: BatchExporter, sampler: Sampler | None = None) -> None:
        self._exporter = exporter
        self._sampler = sampler or Sampler()

    def start_request(self, headers: Iterable[tuple[bytes, bytes]], name: str, start_ns: int) -> Span | None:
        """The request's root span, continuing the client's `traceparent` when it sent a valid one; None when the
        sampler leaves this trace out (then no child span is made either)."""
        parent: tuple[int, int, bool] | None = None
        trace_state = ""
        for key, value in headers:
            if key == b"traceparent":
                parent = parse_traceparent(value.decode("latin-1"))
            elif key == b"tracestate" and len(value) <= _MAX_TRACESTATE:
                trace_state = value.decode("latin-1")
        trace_id = parent[0] if parent is not None else random.getrandbits(128) or 1
        if not self._sampler.is_sampled(trace_id, parent[2] if parent is not None else None):
            return None
        record = EncodedSpan(
            span_id=random.getrandbits(64) or 1,
            parent_id=parent[1] if parent is not None else 0,
            name=name,
            kind=self.server_kind,
            start_ns=start_ns,
            end_ns=0,
            parent_is_remote=parent is not None,
        )
        return Span(_Trace(trace_id, trace_state if parent is not None else ""), record, self._exporter)

    def start_child(
        self, parent: Span, name: str, *, start_ns: int, kind: int | None = None, attributes: Any = None
    ) -> Span:
        record = EncodedSpan(
            span_id=random.getrandbits(64) or 1,
            parent_id=parent.span_id,
            name=name,
            kind=kind if kind is not None else self.internal_kind,
            start_ns=start_ns,
            end_ns=0,
            attributes=list(attributes.items()) if attributes else [],
        )
        return Span(parent.trace, record, None)

    def headers_for(self, span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span` as the parent, for a call to an upstream."""
        headers = {"traceparent": f"00-{span.trace.trace_id:032x}-{span.span_id:016x}-01"}
        if span.trace.trace_state:
            headers["tracestate"] = span.trace.trace_state
        return headers

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread."""
        self._exporter.shutdown()


class BatchExporter:
    """Requests' finished spans, queued by the event loop and sent in batches by one thread: every `delay_s`, or as
    soon as `batch_spans` are waiting. Over `max_queue_spans` waiting (the collector is slow or gone), new spans are
    dropped and counted, never held in memory without bound."""

    def __init__(
        self,
        send: Callable[[bytes], bool],
        resource: bytes,
        *,
        close: Callable[[], None] = lambda: None,
        delay_s: float = 5.0,
        max_queue_spans: int = 2048,
        batch_spans: int = 512,
    ) -> None:
        self._send, self._resource, self._close = send, resource, close
        self._delay_s, self._max_queue_spans, self._batch_spans = delay_s, max_queue_spans, batch_spans
        self._queue: deque[_Trace] = deque()
        # Written by one thread each, so neither loses a count: spans waiting = queued - taken.
        self._num_queued = 0
        self._num_taken = 0
        self.num_dropped = 0
        self.num_sent = 0
        self._last_drop_log = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="unigate-otlp-export", daemon=True)
        self._thread.start()

    def submit(self, trace: _Trace) -> None:
        count = len(trace.spans)
        waiting = self._num_queued - self._num_taken
        if waiting + count > self._max_queue_spans:
            self.num_dropped += count
            if time.monotonic() - self._last_drop_log > 60:
                self._last_drop_log = time.monotonic()
                logger.warning("span export queue full (%d spans): dropping spans", self._max_queue_spans)
            return
        self._queue.append(trace)
        self._num_queued += count
        if waiting + count >= self._batch_spans:
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self._drain()

    def _drain(self) -> None:
        while self._queue:
            batch: list[_Trace] = []
            count = 0
            while self._queue and count < self._batch_spans:
                trace = self._queue.popleft()
                batch.append(trace)
                count += len(trace.spans)
            self._num_taken += count
            body = encode_request(
                self._resource,
                "unigate",
                ((t.trace_id.to_bytes(16, "big"), t.trace_state, t.spans) for t in batch),
            )
            try:
                if self._send(body):
                    self.num_sent += count
            except Exception:  # the exporter's client logs its own failures; nothing may stop this thread
                logger.exception("span export failed")

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._drain()
        self._close()
