"""OpenTelemetry traces, off unless the standard `OTEL_*` variables ask for them.

On when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Read as the specification says: `OTEL_SERVICE_NAME`
(default here: "unigate") and `OTEL_RESOURCE_ATTRIBUTES` (the SDK's `Resource`), `OTEL_TRACES_SAMPLER` /
`OTEL_TRACES_SAMPLER_ARG` (the six standard samplers; default `parentbased_always_on`), `OTEL_BSP_SCHEDULE_DELAY`
(ms), `OTEL_BSP_MAX_QUEUE_SIZE` and `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (spans), and the OTLP exporter's own
`OTEL_EXPORTER_OTLP_*` headers, timeout, compression and certificates.

Why not the SDK's tracer: a request makes six or seven spans, and the SDK's spans (locks, bounded attribute maps,
processor hooks) and its protobuf encoder cost ~260 µs of CPU per request, two thirds of what the gateway spends
on the request itself. Here the request's path only notes times and ids (gateway/request_spans.py: one tuple per
finished span, `otlp_encoding.SpanRow`); when the request ends its rows are pickled (one C call) and queued, and
each full batch goes through a pipe to a child process (gateway/otlp_sender.py) that writes it to the wire format
directly (gateway/otlp_encoding.py) and posts it with the SDK's own OTLP/HTTP exporter client (its retries,
headers, compression and TLS), so what reaches the collector is standard OTLP/HTTP protobuf. Encoding on the event
loop had cost ~10 µs a traced request, and posting from a thread of the gateway ~35 µs more. A request the
sampler leaves out records nothing (~2 µs).

The spans of a request are opened by its trace (gateway/request_trace.py); this module makes them, samples,
exports, and moves context in and out of W3C `traceparent` headers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.otlp_encoding import SpanRow, encode_request, encode_spans
from gateway.otlp_sender import SenderProcess, pickle_trace

__all__ = [
    "BatchExporter",
    "Sampler",
    "Trace",
    "TraceSpans",
    "Tracing",
    "new_span_id",
    "otlp_batch",
    "parse_traceparent",
    "tracing_from_env",
]

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
        # Only checked here: the sender process (gateway/otlp_sender.py) uses them.
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.resources  # noqa: F401
    except ImportError:
        logger.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is not installed: serving without traces "
            "(pip install 'unigate[otel]')"
        )
        return None
    sender = SenderProcess(environ)
    batches = BatchExporter(
        sender.send,
        pack=pickle_trace,  # bytes wait, not span lists the collector would traverse; the sender encodes them
        encode=b"".join,
        close=sender.close,
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
class Trace:
    """One sampled request's trace: its ids, and the rows of its finished spans (gateway/request_spans.py appends
    them; the span sender encodes them once the request has ended)."""

    trace_id: int
    trace_state: str  # the client's `tracestate`, passed on ("": none)
    root_id: int  # the request's own span
    parent_id: int = 0  # the client's span (0: the request started this trace)
    rows: list[SpanRow] = field(default_factory=list)


class Tracing:
    """Traces for one app's requests, exported in batches (never the process-wide tracer: several apps may live in
    one process)."""

    server_kind = 2
    client_kind = 3
    internal_kind = 1

    def __init__(self, exporter: BatchExporter, sampler: Sampler | None = None) -> None:
        self._exporter = exporter
        self._sampler = sampler or Sampler()

    def start_request(self, headers: Iterable[tuple[bytes, bytes]]) -> Trace | None:
        """A request's trace, continuing the client's `traceparent` when it sent a valid one; None when the sampler
        leaves it out (then nothing of it is recorded)."""
        parent: tuple[int, int, bool] | None = None
        trace_state = ""
        for key, value in headers:
            if key == b"traceparent":
                parent = parse_traceparent(value.decode("latin-1"))
            elif key == b"tracestate" and len(value) <= _MAX_TRACESTATE:
                trace_state = value.decode("latin-1")
        if parent is None:
            trace_id = random.getrandbits(128) or 1
            return Trace(trace_id, "", new_span_id()) if self._sampler.is_sampled(trace_id, None) else None
        trace_id, parent_id, is_sampled = parent
        if not self._sampler.is_sampled(trace_id, is_sampled):
            return None
        return Trace(trace_id, trace_state, new_span_id(), parent_id)

    @staticmethod
    def headers_for(trace: Trace, span_id: int) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming span `span_id` as the parent, for a call to an upstream."""
        headers = {"traceparent": f"00-{trace.trace_id:032x}-{span_id:016x}-01"}
        if trace.trace_state:
            headers["tracestate"] = trace.trace_state
        return headers

    def export(self, trace: Trace) -> None:
        """Queue a finished request's spans (never waits); they are encoded with their batch."""
        self._exporter.submit((trace.trace_id, trace.trace_state, trace.rows), len(trace.rows))

    def shutdown(self) -> None:
        """Export what is queued and stop the span sender once it has sent it."""
        self._exporter.shutdown()


def new_span_id() -> int:
    return random.getrandbits(64) or 1


TraceSpans = tuple[int, str, list[SpanRow]]  # a finished request's trace id, `tracestate` and span rows


def otlp_batch(resource: bytes) -> Callable[[list[TraceSpans]], bytes]:
    """A batch of traces as one OTLP `ExportTraceServiceRequest` under `resource` (encoded attributes)."""

    def encode(traces: list[TraceSpans]) -> bytes:
        return encode_request(resource, "unigate", [encode_spans(*trace) for trace in traces])

    return encode


class BatchExporter:
    """Requests' finished spans, queued on the event loop and handed on in batches, on the loop itself: as soon as
    `batch_spans` wait, else `delay_s` after the first of a batch came (no loop running: at the next full batch or
    the stop). A trace waits as `pack` makes it (by default as it is); a batch is made bytes by `encode` (by
    default an OTLP request under `resource`) and given to `send`,
    which must not block (the gateway's sends to a pipe, gateway/otlp_sender.py). A batch `send` refuses (or raises
    for) is dropped and its spans counted, as are spans past `max_queue_spans` waiting: never held without bound.

    No thread: a second thread of the gateway that woke for each batch cost the event loop more than the batch's
    work, in GIL hand-offs (measured: ~40-75 µs a traced request at c=32)."""

    def __init__(
        self,
        send: Callable[[bytes], bool],
        resource: bytes = b"",
        *,
        pack: Callable[[TraceSpans], Any] | None = None,
        encode: Callable[[list[Any]], bytes] | None = None,
        close: Callable[[], None] = lambda: None,
        delay_s: float = 5.0,
        max_queue_spans: int = 2048,
        batch_spans: int = 512,
    ) -> None:
        self._send, self._close = send, close
        self._pack = pack
        self._encode = encode or otlp_batch(resource)
        self._delay_s, self._max_queue_spans, self._batch_spans = delay_s, max_queue_spans, batch_spans
        self._queue: deque[tuple[Any, int]] = deque()  # (a trace's spans as `pack` made them, how many)
        self._num_waiting = 0
        self._timer: asyncio.TimerHandle | None = None
        self.num_dropped = 0
        self.num_sent = 0
        self._last_drop_log = 0.0

    def submit(self, spans: TraceSpans, count: int) -> None:
        if self._num_waiting + count > self._max_queue_spans:
            self._dropped(count, f"span export queue full ({self._max_queue_spans} spans)")
            return
        self._queue.append((spans if self._pack is None else self._pack(spans), count))
        self._num_waiting += count
        if self._num_waiting >= self._batch_spans:
            self._drain(full_only=True)
        if self._queue and self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._timer = loop.call_later(self._delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._drain()

    def _drain(self, *, full_only: bool = False) -> None:
        while self._queue and (not full_only or self._num_waiting >= self._batch_spans):
            batch: list[Any] = []
            count = 0
            while self._queue and count < self._batch_spans:
                spans, num_spans = self._queue.popleft()
                batch.append(spans)
                count += num_spans
            self._num_waiting -= count
            try:
                is_sent = self._send(self._encode(batch))
            except Exception:  # nothing may stop the exporter (nor the request whose spans filled the batch)
                logger.exception("span export failed")
                is_sent = False
            if is_sent:
                self.num_sent += count
            else:
                self._dropped(count, "the span sender did not take a batch")

    def _dropped(self, count: int, why: str) -> None:
        self.num_dropped += count
        if time.monotonic() - self._last_drop_log > 60:
            self._last_drop_log = time.monotonic()
            logger.warning("%s: dropping spans (%d so far)", why, self.num_dropped)

    def shutdown(self) -> None:
        """Hand on what waits, then close the sender (which sends it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._drain()
        self._close()
