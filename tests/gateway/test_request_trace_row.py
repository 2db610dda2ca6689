"""The request log's record as the trace builds it on every request: its values in `RequestRecord`'s field order
(a tuple, not a record object), encoded as the same JSON a `RequestRecord` is."""

from __future__ import annotations

import dataclasses

import orjson

from auth.base import Principal, SettleUsage
from auth.request_log import AttemptRecord, RequestLog, RequestRecord
from gateway.request_trace import RequestTrace

KEY = Principal("key_0123456789abcdef", "ci", team_id="team_a")


def finished(
    trace: RequestTrace, *, status: int, client_left: bool, route: str = "/v1/chat/completions"
) -> RequestRecord:
    row = trace.finish(request_id="req-1", route=route, status=status, client_left=client_left)
    assert row is not None and len(row) == len(dataclasses.fields(RequestRecord))
    return RequestRecord.from_json(orjson.dumps(row))


def test_the_row_reads_back_as_the_record_of_what_happened() -> None:
    trace = RequestTrace.begin({"method": "POST", "path": "/v1/chat/completions", "headers": []})
    trace.authenticated(KEY)
    trace.requested("chat/completions", "m", {"model": "m"}, stream=True)
    trace.attempted("d0", 503, 0.0123456, "upstream_unavailable")
    trace.attempted("d1", 200, 0.5)
    trace.answered("d1", "m-backup")
    trace.first_token()
    trace.settled(SettleUsage(10, 20, cost_micros=1234, is_estimated=True), num_cached_tokens=4)
    record = finished(trace, status=200, client_left=False)
    assert (record.request_id, record.key_id, record.key_name, record.team_id) == ("req-1", KEY.key_id, "ci", "team_a")
    assert (record.api, record.route, record.model, record.deployment) == ("openai", "/v1/chat/completions", "m", "d1")
    assert (record.status, record.code, record.ended_by, record.is_stream) == (200, "", "finished", True)
    assert record.fallback == "m-backup"
    assert [(a.deployment, a.status, a.duration_ms, a.code) for a in record.attempts] == [
        ("d0", 503, 12.35, "upstream_unavailable"),
        ("d1", 200, 500.0, ""),
    ]
    assert all(isinstance(a, AttemptRecord) for a in record.attempts)
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (10, 20, 4)
    assert (record.is_estimated, record.cost_micros) == (True, 1234)
    assert record.ttft_ms is not None and 0 <= record.ttft_ms <= record.duration_ms
    assert record.time_ms == trace.started_ns // 1_000_000


def test_how_it_ended_and_a_request_without_a_verified_key() -> None:
    scope = {"method": "POST", "path": "/v1/messages", "headers": []}
    left = RequestTrace.begin(dict(scope))
    left.authenticated(KEY)
    record = finished(left, status=499, client_left=True, route="/v1/messages")
    assert (record.api, record.code, record.ended_by, record.fallback) == (
        "anthropic",
        "client_disconnected",
        "client_left",
        None,
    )
    timed_out = RequestTrace.begin(dict(scope))
    timed_out.authenticated(KEY)
    timed_out.failed("upstream_timeout")
    timed_out.failed("internal_error")  # an echo of the first: the first code stays
    assert finished(timed_out, status=504, client_left=False).ended_by == "timeout"
    failed = RequestTrace.begin(dict(scope))
    failed.authenticated(KEY)
    assert finished(failed, status=429, client_left=False).ended_by == "error"
    anonymous = RequestTrace.begin(dict(scope))
    assert anonymous.finish(request_id="r", route="/v1/messages", status=401, client_left=False) is None


def test_a_row_and_its_record_queue_the_same_bytes() -> None:
    trace = RequestTrace.begin({"method": "POST", "path": "/v1/responses", "headers": []})
    trace.authenticated(KEY)
    trace.attempted("d0", 200, 0.25)
    row = trace.finish(request_id="req-9", route="/v1/responses", status=200, client_left=False)
    assert row is not None
    by_row, by_record = RequestLog(None), RequestLog(None)  # type: ignore[arg-type]  # nothing is written
    by_row.add_row(row)
    by_record.add(RequestRecord.from_json(orjson.dumps(row)))
    assert list(by_row._buffer) == list(by_record._buffer) == [("req-9\n", orjson.dumps(row) + b"\n")]
