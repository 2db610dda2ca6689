"""An upstream's own text about a server-side failure (5xx, 529, an error body or stream event) never reaches the
client — it may name internal hosts — but the gateway's log has it under the request id, and the client's message
names the model and that id. A 4xx's text is relayed: it tells the caller what to fix (docs/gateway.md, errors)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest
from fakes.app import AUTH, CHAT, asgi_client, build_app, single_model
from fakes.upstream import Behavior, FakeUpstream

from backends.anthropic import AnthropicDialect
from backends.config import UpstreamConfig
from backends.upstream_errors import UpstreamErrors
from gateway.errors import BackendError

HOST = "pool-7.internal.example.net:8443"
LEAK = f"backend {HOST} refused the connection"
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/messages": {**CHAT, "max_tokens": 16},
    "/v1/responses": {"model": "gpt-test", "input": "Hello there"},
}


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]  # type: ignore[no-any-return]  # OpenAI and Anthropic envelopes alike


def assert_withheld(response: httpx.Response, text: str, caplog: pytest.LogCaptureFixture) -> None:
    request_id = response.headers["x-request-id"]
    assert HOST not in response.text and "refused the connection" not in response.text
    assert "'gpt-test'" in text and request_id in text, text
    [line] = [r.getMessage() for r in caplog.records if HOST in r.getMessage()]
    assert request_id in line and "gpt-test#0" in line
    assert [r.levelno for r in caplog.records if HOST in r.getMessage()] == [logging.WARNING]


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("behavior", "status", "code"),
    [
        (Behavior(mode="status", status=503, message=LEAK), 502, "upstream_error"),
        (Behavior(mode="status", status=500, message=LEAK), 502, "upstream_error"),
        (Behavior(mode="status", status=529, variant="anthropic:overloaded_error", message=LEAK), 503, None),
        (Behavior(mode="status", status=200, message=LEAK), 502, "upstream_error"),  # an error body with a 200
    ],
    ids=["503", "500", "529", "200-error-body"],
)
async def test_a_server_errors_text_is_logged_not_relayed(
    fake_upstream: FakeUpstream,
    caplog: pytest.LogCaptureFixture,
    path: str,
    stream: bool,
    behavior: Behavior,
    status: int,
    code: str | None,
) -> None:
    fake_upstream.behave(behavior)
    app = build_app(single_model(fake_upstream, router={"num_retries": 0}))
    with caplog.at_level(logging.WARNING, logger="unigate"):
        async with asgi_client(app) as client:
            response = await client.post(path, json={**BODIES[path], "stream": stream}, headers=AUTH)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["code"] == (code or "upstream_overloaded")
    assert_withheld(response, error["message"], caplog)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_an_error_event_mid_stream_is_logged_not_relayed(
    fake_upstream: FakeUpstream, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    fake_upstream.behave(mode="error_chunk", cut_after=2, message=LEAK)
    app = build_app(single_model(fake_upstream, router={"num_retries": 0}))
    with caplog.at_level(logging.WARNING, logger="unigate"):
        async with asgi_client(app) as client:
            response = await client.post(path, json={**BODIES[path], "stream": True}, headers=AUTH)
    assert response.status_code == 200  # the stream had started: its error is an event in it
    events = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    failed = [e for e in events if e.get("error") or (e.get("response") or {}).get("error")]
    assert failed, response.text
    last = failed[-1]
    text = (last.get("response") or last)["error"]["message"]
    assert_withheld(response, text, caplog)


@pytest.mark.parametrize(
    ("behavior", "status"),
    [
        (Behavior(mode="status", status=400, message=f"`tools[0]` is invalid, see {HOST}"), 400),
        (Behavior(mode="status", status=404, message=f"no model here, see {HOST}"), 404),
        (Behavior(mode="status", status=429, message=f"slow down, see {HOST}"), 429),
    ],
    ids=["400", "404", "429"],
)
async def test_a_client_errors_text_is_relayed(fake_upstream: FakeUpstream, behavior: Behavior, status: int) -> None:
    """A 4xx says what the caller should fix: its text comes through (redacted of keys and the base_url's host)."""
    fake_upstream.behave(behavior)
    async with asgi_client(build_app(single_model(fake_upstream, router={"num_retries": 0}))) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == status, response.text
    assert behavior.message in error_of(response)["message"]


def test_an_anthropic_error_event_is_withheld_and_a_rate_limit_event_relayed() -> None:
    errors = UpstreamErrors(UpstreamConfig("claude#0", base_url="http://127.0.0.1:9/v1", api_key="sk-ant-secret-123"))
    dialect = AnthropicDialect()
    for kind, code in (("overloaded_error", "upstream_overloaded"), ("api_error", "upstream_error")):
        event = {"type": "error", "error": {"type": kind, "message": LEAK}}
        with pytest.raises(BackendError) as caught:
            dialect.parse_event(orjson.dumps(event), errors)
        assert caught.value.code == code and HOST not in caught.value.message
        assert caught.value.upstream_text is not None and HOST in caught.value.upstream_text
    limited = {"type": "error", "error": {"type": "rate_limit_error", "message": f"slow down ({HOST})"}}
    with pytest.raises(BackendError) as caught:
        dialect.parse_event(orjson.dumps(limited), errors)
    assert caught.value.status_code == 429 and HOST in caught.value.message
