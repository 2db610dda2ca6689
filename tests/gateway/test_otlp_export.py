"""The gateway's own span records and their OTLP encoding, checked against opentelemetry-proto's decoder: any
spans and attributes (hypothesis) come back field for field; the samplers follow the specification; W3C
`traceparent` parsing accepts exactly the valid headers; the batch exporter bounds its queue, survives a failing
collector and sends what is queued when it stops."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("opentelemetry.proto")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.otlp_encoding import SpanRow, encode_attributes, encode_request, encode_spans
from gateway.request_spans import RequestSpans
from gateway.tracing import BatchExporter, Sampler, Tracing, parse_traceparent

_ids = st.integers(min_value=1, max_value=2**64 - 1)
_times = st.integers(min_value=0, max_value=2**63)
_values = st.one_of(
    st.text(max_size=40),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)
_attributes = st.lists(st.tuples(st.text(min_size=1, max_size=30), _values), max_size=8)
_spans = st.tuples(
    st.text(max_size=60),
    _ids,
    st.one_of(st.just(0), _ids),
    st.sampled_from([1, 2, 3]),
    _times,
    _times,
    _attributes,
    st.one_of(st.just(""), st.text(min_size=1, max_size=20)),
    st.booleans(),
)
_traces = st.lists(
    st.tuples(st.integers(min_value=1, max_value=2**128 - 1), st.text(max_size=30), st.lists(_spans, max_size=5)),
    max_size=4,
)


def _value(any_value: object) -> object:
    return getattr(any_value, any_value.WhichOneof("value"))  # type: ignore[attr-defined]


@settings(max_examples=200, deadline=None)
@given(_traces, st.dictionaries(st.text(min_size=1, max_size=20), _values, max_size=4))
def test_what_is_encoded_decodes_field_for_field(
    traces: list[tuple[int, str, list[SpanRow]]], resource: dict[str, object]
) -> None:
    body = encode_request(encode_attributes(resource), "unigate", [encode_spans(t, s, rows) for t, s, rows in traces])
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    (resource_spans,) = request.resource_spans
    assert {a.key: _value(a.value) for a in resource_spans.resource.attributes} == resource
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "unigate"
    expected = [(trace_id, state, span) for trace_id, state, spans in traces for span in spans]
    assert len(scope_spans.spans) == len(expected)
    for decoded, (trace_id, state, span) in zip(scope_spans.spans, expected, strict=True):
        name, span_id, parent_id, kind, start_ns, end_ns, span_attributes, error_type, parent_is_remote = span
        assert decoded.trace_id == trace_id.to_bytes(16, "big")
        assert decoded.span_id == span_id.to_bytes(8, "big")
        assert decoded.parent_span_id == (parent_id.to_bytes(8, "big") if parent_id else b"")
        assert decoded.trace_state == state
        assert (decoded.name, decoded.kind) == (name, kind)
        assert (decoded.start_time_unix_nano, decoded.end_time_unix_nano) == (start_ns, end_ns)
        error_attribute = [("error.type", error_type)] if error_type else []
        assert [(a.key, _value(a.value)) for a in decoded.attributes] == span_attributes + error_attribute
        assert decoded.status.code == (decoded.status.STATUS_CODE_ERROR if error_type else 0)
        assert decoded.flags & 0xFF == 1 and decoded.flags & 0x100
        assert bool(decoded.flags & 0x200) == parent_is_remote


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, True),
        ),
        (
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, False),
        ),
        (
            " 00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01 ",
            (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, True),
        ),
        (
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future",
            (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0xF067AA0BA902B7, True),
        ),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),  # version 00 has no more fields
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", None),
        ("00-zzf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("", None),
    ],
)
def test_traceparent_is_read_as_w3c_says(header: str, expected: tuple[int, int, bool] | None) -> None:
    assert parse_traceparent(header) == expected


def test_the_samplers_follow_the_specification() -> None:
    def sampler(name: str, arg: str | None = None) -> Sampler:
        environ = {"OTEL_TRACES_SAMPLER": name} | ({"OTEL_TRACES_SAMPLER_ARG": arg} if arg is not None else {})
        return Sampler.from_env(environ)

    low, high = 5, 2**64 - 5  # trace ids whose low 64 bits are tiny / huge
    assert Sampler.from_env({}) == Sampler(parent_based=True, ratio=1.0)
    assert sampler("always_on").is_sampled(high, False)  # not parent-based: the parent's flag is ignored
    assert not sampler("always_off").is_sampled(low, True)
    assert sampler("parentbased_always_off").is_sampled(low, True)
    assert not sampler("parentbased_always_off").is_sampled(low, None)
    assert not sampler("parentbased_always_on").is_sampled(low, False)
    ratio = sampler("traceidratio", "0.25")
    assert ratio.is_sampled(low, None) and not ratio.is_sampled(high, None)
    assert ratio.is_sampled(2**64 // 4 - 1, None) and not ratio.is_sampled(2**64 // 4 + 1, None)
    assert sampler("parentbased_traceidratio", "0").is_sampled(high, True)
    assert sampler("traceidratio", "7").ratio == 1.0 and sampler("traceidratio", "x").ratio == 1.0
    assert sampler("nonsense") == Sampler(parent_based=True, ratio=1.0)


def test_a_traceidratio_keeps_about_its_share() -> None:
    tracing = Tracing(BatchExporter(lambda body: True, b"", delay_s=60), Sampler(parent_based=True, ratio=0.1))
    kept = sum(tracing.start_request(()) is not None for _ in range(20_000))
    tracing.shutdown()
    assert 1_600 < kept < 2_400  # binomial(20000, 0.1): mean 2000, sd 42


def _trace_of(tracing: Tracing, children: int) -> None:
    trace = tracing.start_request(())
    assert trace is not None
    spans = RequestSpans(tracing, trace, "r", 1)
    spans.first_token(2)  # a stream left open: it ends with the request
    for _ in range(children - 1):
        spans.add("c", 2, 3)
    spans.finish(
        status=200, code="", deployment=None, served_model=None, usage=None, request_id="x", ended_by="finished"
    )


def test_full_batches_go_out_a_refused_one_is_counted_and_a_stop_sends_what_waits() -> None:
    bodies: list[bytes] = []

    def send(body: bytes) -> bool:
        bodies.append(body)
        return len(bodies) > 1  # the first batch is refused (the sender is behind, or gone)

    exporter = BatchExporter(send, encode_attributes({"service.name": "t"}), delay_s=60, batch_spans=5)
    tracing = Tracing(exporter)
    for _ in range(7):
        _trace_of(tracing, 2)  # 3 spans each (root, stream, one more): a batch goes out at every second trace
    assert len(bodies) == 3 and exporter.num_dropped == 6 and exporter.num_sent == 12
    tracing.shutdown()  # the seventh trace waited for a full batch: the stop sends it
    assert len(bodies) == 4 and exporter.num_sent == 15
    spans = []
    for body in bodies[1:]:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans += request.resource_spans[0].scope_spans[0].spans
    assert len(spans) == exporter.num_sent
    roots = {s.span_id: s for s in spans if s.name == "r"}
    for span in spans:
        if span.name != "r":
            root = roots[span.parent_span_id]
            assert span.end_time_unix_nano <= root.end_time_unix_nano
    streams = [s for s in spans if s.name == "unigate.stream"]  # left open: ended with the request
    assert streams and all(s.end_time_unix_nano == roots[s.parent_span_id].end_time_unix_nano for s in streams)


def test_spans_past_the_queue_bound_are_dropped_and_counted() -> None:
    sent: list[bytes] = []
    exporter = BatchExporter(lambda body: sent.append(body) is None, b"", max_queue_spans=4, batch_spans=5)
    tracing = Tracing(exporter)
    _trace_of(tracing, 2)  # 3 spans wait (under a batch)
    _trace_of(tracing, 2)  # 3 more would be 6 > 4
    assert exporter.num_dropped == 3 and not sent
    tracing.shutdown()
    assert len(sent) == 1 and exporter.num_sent == 3


async def test_on_the_event_loop_a_partial_batch_goes_out_after_the_delay() -> None:
    sent: list[bytes] = []
    exporter = BatchExporter(lambda body: sent.append(body) is None, b"", delay_s=0.05, batch_spans=512)
    tracing = Tracing(exporter)
    _trace_of(tracing, 2)
    assert not sent
    for _ in range(200):  # the timer fires ~0.05 s after the first span waited; bounded, not a timing assertion
        await asyncio.sleep(0.01)
        if sent:
            break
    assert len(sent) == 1 and exporter.num_sent == 3
    tracing.shutdown()
    assert len(sent) == 1  # nothing was left for the stop


def test_a_failing_collector_does_not_stop_the_exporter() -> None:
    calls: list[int] = []

    def send(body: bytes) -> bool:
        calls.append(len(body))
        if len(calls) == 1:
            raise ConnectionError("collector gone")
        return len(calls) > 2

    exporter = BatchExporter(send, b"", delay_s=60, batch_spans=2)
    tracing = Tracing(exporter)
    for _ in range(3):
        _trace_of(tracing, 1)  # 2 spans each: one batch per trace
    tracing.shutdown()
    assert len(calls) == 3 and exporter.num_sent == 2
