"""Finished spans → an OTLP `ExportTraceServiceRequest`, written straight to the protobuf wire format.

The OpenTelemetry SDK's encoder builds a message object per span, attribute and value, then serialises them; for
the six or seven spans of one request that was ~130 µs of the gateway's CPU, more than the rest of tracing. A
request's spans are few and their attributes repeat (model ids, deployment names, status codes), so here each span
is written to bytes directly and each (key, value) attribute pair is encoded once and then found in a small cache.
The layout is opentelemetry-proto's (trace/v1/trace.proto, common/v1/common.proto); tests decode it with that
package's classes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["EncodedSpan", "encode_attributes", "encode_request"]

_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_SMALL = [bytes([n]) for n in range(128)]
_CACHE_LIMIT = 4096
_attribute_cache: dict[tuple[str, type, object], bytes] = {}

# OTLP Span.flags: the W3C trace flags (sampled) plus "we know whether the parent is remote" and "it is".
_FLAGS_LOCAL_PARENT = b"\x85\x01" + struct.pack("<I", 0x101)
_FLAGS_REMOTE_PARENT = b"\x85\x01" + struct.pack("<I", 0x301)


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL[value] if value >= 0 else _varint(value + (1 << 64))
    out = bytearray()
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (`tag`, under 128, already holds the field number and wire type 2)."""
    return _SMALL[tag] + _varint(len(payload)) + payload


def _any_value(value: object) -> bytes:
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    return _field(0x0A, str(value).encode())


def _key_value(key: str, value: object) -> bytes:
    """One `KeyValue` as the attributes field (9) of a span; cached per (key, type, value)."""
    cache_key = (key, type(value), value)
    found = _attribute_cache.get(cache_key)
    if found is None:
        found = _field(0x4A, _field(0x0A, key.encode()) + _field(0x12, _any_value(value)))
        if len(_attribute_cache) >= _CACHE_LIMIT:
            _attribute_cache.clear()
        _attribute_cache[cache_key] = found
    return found


def encode_attributes(attributes: Mapping[str, object]) -> bytes:
    """A `Resource`'s attributes (field 1 each)."""
    return b"".join(
        _field(0x0A, _field(0x0A, key.encode()) + _field(0x12, _any_value(v))) for key, v in attributes.items()
    )


@dataclass(slots=True)
class EncodedSpan:
    """What the encoder needs of one finished span (gateway/tracing.py's spans hand these over)."""

    span_id: int
    parent_id: int  # 0: a root without a parent
    name: str
    kind: int  # OTLP SpanKind: 1 internal, 2 server, 3 client
    start_ns: int
    end_ns: int
    attributes: list[tuple[str, object]] = field(default_factory=list)
    error_type: str = ""  # set: status ERROR
    parent_is_remote: bool = False


def _span(span: EncodedSpan, trace_id: bytes, trace_state: bytes) -> bytes:
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span.span_id.to_bytes(8, "big")]
    if trace_state:
        parts.append(trace_state)
    if span.parent_id:
        parts += (b"\x22\x08", span.parent_id.to_bytes(8, "big"))
    parts += (
        _field(0x2A, span.name.encode()),
        b"\x30",
        _SMALL[span.kind],
        b"\x39",
        _FIXED64.pack(span.start_ns),
        b"\x41",
        _FIXED64.pack(span.end_ns),
    )
    parts += [_key_value(key, value) for key, value in span.attributes]
    if span.error_type:
        parts.append(_field(0x7A, b"\x18\x02"))  # Status { code: STATUS_CODE_ERROR }
    parts.append(_FLAGS_REMOTE_PARENT if span.parent_is_remote else _FLAGS_LOCAL_PARENT)
    return _field(0x12, b"".join(parts))  # ScopeSpans.spans


def encode_request(
    resource_attributes: bytes, scope_name: str, traces: Iterable[tuple[bytes, str, Sequence[EncodedSpan]]]
) -> bytes:
    """One ExportTraceServiceRequest: one resource, one scope, every span of `traces` ((trace id, tracestate,
    spans) each)."""
    spans = []
    for trace_id, trace_state, trace_spans in traces:
        state = _field(0x1A, trace_state.encode()) if trace_state else b""
        spans += [_span(span, trace_id, state) for span in trace_spans]
    scope_spans = _field(0x0A, _field(0x0A, scope_name.encode())) + b"".join(spans)
    resource_spans = _field(0x0A, resource_attributes) + _field(0x12, scope_spans)
    return _field(0x0A, resource_spans)
