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

__all__ = ["SpanRow", "encode_attributes", "encode_request", "encode_spans"]

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


# One finished span, as gateway/request_spans.py records it (a plain tuple: made on the request's path, read here
# in the export thread): name, span id, parent span id (0: none), OTLP kind (1 internal, 2 server, 3 client),
# start and end (ns since the epoch), attributes ((key, value) pairs), error type ("": none), parent is remote.
SpanRow = tuple[str, int, int, int, int, int, Sequence[tuple[str, object]], str, bool]


def _span(row: SpanRow, trace_id: bytes, trace_state: bytes) -> bytes:
    name, span_id, parent_id, kind, start_ns, end_ns, attributes, error_type, parent_is_remote = row
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big")]
    if trace_state:
        parts.append(trace_state)
    if parent_id:
        parts += (b"\x22\x08", parent_id.to_bytes(8, "big"))
    parts += (
        _field(0x2A, name.encode()),
        b"\x30",
        _SMALL[kind],
        b"\x39",
        _FIXED64.pack(start_ns),
        b"\x41",
        _FIXED64.pack(end_ns),
    )
    parts += [_key_value(key, value) for key, value in attributes]
    if error_type:
        parts += (_key_value("error.type", error_type), _field(0x7A, b"\x18\x02"))  # Status { code: ERROR }
    parts.append(_FLAGS_REMOTE_PARENT if parent_is_remote else _FLAGS_LOCAL_PARENT)
    return _field(0x12, b"".join(parts))  # ScopeSpans.spans


def encode_spans(trace_id: int, trace_state: str, rows: Iterable[SpanRow]) -> bytes:
    """One trace's spans, as the `spans` fields of a ScopeSpans (pieces that `encode_request` joins)."""
    trace_bytes = trace_id.to_bytes(16, "big")
    state = _field(0x1A, trace_state.encode()) if trace_state else b""
    return b"".join([_span(row, trace_bytes, state) for row in rows])


def encode_request(resource_attributes: bytes, scope_name: str, spans: Iterable[bytes]) -> bytes:
    """One ExportTraceServiceRequest: one resource, one scope, the spans `encode_spans` wrote."""
    scope_spans = _field(0x0A, _field(0x0A, scope_name.encode())) + b"".join(spans)
    resource_spans = _field(0x0A, resource_attributes) + _field(0x12, scope_spans)
    return _field(0x0A, resource_spans)
