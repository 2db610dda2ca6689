"""OpenTelemetry traces end to end: a gateway configured only through `OTEL_*` variables exports over OTLP/HTTP to
a receiver in this process, which decodes the protobuf with `opentelemetry-proto`. Checked: the span tree of one
request, the GenAI attributes, the client's `traceparent` continued, the upstream called with the attempt's span as
parent, errors marked, and no prompt or answer text anywhere in the export. Off without the variables."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fakes.app import MASTER, build_app, deployment
from fakes.server import ThreadedServer
from fakes.upstream import PROMPT_TOKENS, Behavior, FakeUpstream

pytest.importorskip("opentelemetry.sdk")
from fakes.otlp import OtlpReceiver, span_attributes

from gateway.tracing import tracing_from_env

SECRET_PROMPT = "my password is hunter2 and the vault code 8812"
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def run_gateway(
    monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, upstream: FakeUpstream, requests: list[dict[str, Any]]
) -> list[httpx.Response]:
    """Serve a traced gateway, send `requests` (kwargs for httpx), stop it (which flushes the spans)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-under-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    models = {"models": [{"id": "m", "deployments": [deployment(upstream, name="up", max_in_flight=4)]}]}
    server = ThreadedServer(build_app(routing=models)).start()
    responses = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for request in requests:
                responses.append(client.request("POST", **request))
    finally:
        server.stop()
    return responses


def test_one_request_is_one_span_tree_with_the_genai_attributes(
    monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, fake_upstream: FakeUpstream
) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    headers = {"authorization": f"Bearer {MASTER}", "traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    (response,) = run_gateway(
        monkeypatch, receiver, fake_upstream, [{"url": "/v1/chat/completions", "json": body, "headers": headers}]
    )
    assert response.status_code == 200
    spans = receiver.spans()
    assert receiver.service_names() == {"gateway-under-test"}
    (root,) = [s for s in spans if s.name == "chat m"]
    assert root.trace_id.hex() == CLIENT_TRACE_ID and root.parent_span_id.hex() == CLIENT_SPAN_ID
    assert root.kind == root.SPAN_KIND_SERVER
    values = span_attributes(root)
    assert values["gen_ai.operation.name"] == "chat"
    assert values["gen_ai.request.model"] == "m" and values["gen_ai.response.model"] == "m"
    assert values["gen_ai.request.max_tokens"] == 5
    usage = response.json()["usage"]
    assert values["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == PROMPT_TOKENS
    assert values["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert values["unigate.key_id"] == "master" and values["unigate.deployment"] == "up"
    assert values["unigate.request_id"] == response.headers["x-request-id"]
    assert "error.type" not in values

    children = {s.name: s for s in spans if s.parent_span_id == root.span_id}
    assert set(children) == {"unigate.authenticate", "unigate.admission", "unigate.attempt up", "unigate.settle"}
    assert all(s.trace_id == root.trace_id for s in spans)
    attempt = children["unigate.attempt up"]
    assert attempt.kind == attempt.SPAN_KIND_CLIENT
    assert span_attributes(attempt)["server.address"] == "127.0.0.1"
    assert [s.name for s in spans if s.parent_span_id == attempt.span_id] == ["unigate.upstream_slot"]
    for span in spans:
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano

    # The upstream was called as the attempt's child.
    traceparent = fake_upstream.requests[-1].headers["traceparent"]
    assert traceparent.split("-")[1:3] == [CLIENT_TRACE_ID, attempt.span_id.hex()]

    export = b"".join(receiver.bodies)
    assert b"hunter2" not in export and b"vault" not in export and b"t0 " not in export


def test_a_stream_has_its_own_span_and_an_error_marks_the_root(
    monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.queue(Behavior(), Behavior(mode="status", status=400))
    headers = {"authorization": f"Bearer {MASTER}"}
    stream = {"model": "m", "stream": True, "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    plain = {"model": "m", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    ok, failed = run_gateway(
        monkeypatch,
        receiver,
        fake_upstream,
        [
            {"url": "/v1/chat/completions", "json": stream, "headers": headers},
            {"url": "/v1/chat/completions", "json": plain, "headers": headers},
        ],
    )
    assert ok.status_code == 200 and failed.status_code == 400
    spans = receiver.spans()
    roots = [s for s in spans if s.name == "chat m"]
    assert len(roots) == 2 and roots[0].trace_id != roots[1].trace_id  # no traceparent: a new trace each
    by_request = {span_attributes(r)["unigate.request_id"]: r for r in roots}
    streamed, errored = by_request[ok.headers["x-request-id"]], by_request[failed.headers["x-request-id"]]
    assert "unigate.stream" in {s.name for s in spans if s.parent_span_id == streamed.span_id}
    assert span_attributes(streamed)["unigate.stream"] is True
    assert errored.status.code == errored.status.STATUS_CODE_ERROR
    assert span_attributes(errored)["error.type"] == failed.json()["error"]["code"]
    (failed_attempt,) = [s for s in spans if s.parent_span_id == errored.span_id and s.name == "unigate.attempt up"]
    assert span_attributes(failed_attempt)["http.response.status_code"] == 400
    assert b"hunter2" not in b"".join(receiver.bodies)


def test_tracing_is_off_unless_the_variables_ask(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert tracing_from_env() is None
    assert tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_TRACES_EXPORTER": "none"}) is None
    tracing = tracing_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"})
    assert tracing is not None
    tracing.shutdown()


def test_an_unsampled_request_exports_nothing(
    monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, fake_upstream: FakeUpstream
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    (response,) = run_gateway(
        monkeypatch,
        receiver,
        fake_upstream,
        [{"url": "/v1/chat/completions", "json": body, "headers": {"authorization": f"Bearer {MASTER}"}}],
    )
    assert response.status_code == 200
    assert receiver.spans() == []
    assert "traceparent" not in fake_upstream.requests[-1].headers


def test_a_parent_based_ratio_follows_the_clients_sampled_flag(
    monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver, fake_upstream: FakeUpstream
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": f"Bearer {MASTER}"}
    sampled = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    not_sampled = f"00-{'1' * 32}-{CLIENT_SPAN_ID}-00"
    responses = run_gateway(
        monkeypatch,
        receiver,
        fake_upstream,
        [
            {"url": "/v1/chat/completions", "json": body, "headers": auth},  # no parent: the ratio (0) decides
            {"url": "/v1/chat/completions", "json": body, "headers": auth | {"traceparent": not_sampled}},
            {"url": "/v1/chat/completions", "json": body, "headers": auth | {"traceparent": sampled}},
        ],
    )
    assert [r.status_code for r in responses] == [200, 200, 200]
    spans = receiver.spans()
    assert spans and {s.trace_id.hex() for s in spans} == {CLIENT_TRACE_ID}
    (root,) = [s for s in spans if s.name == "chat m"]
    assert span_attributes(root)["unigate.request_id"] == responses[2].headers["x-request-id"]
