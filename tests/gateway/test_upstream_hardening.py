"""A hostile or broken upstream (issue 25, items 2, 3 and 6), through real servers on loopback: redirects are never
followed, bodies and SSE events are capped (decompressed), a stream without events times out, and a client that
leaves before the first byte cancels the upstream call and frees its lease."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import httpx
import orjson
import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, CHAT, MASTER, asgi_client, build_app, single_model
from fakes.upstream import FakeUpstream
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.openai import OpenAIBackend
from backends.sse import SSEDecoder
from gateway.errors import BackendError

MiB = 1024 * 1024
STREAM = {**CHAT, "stream": True}
GENEROUS_S = 30.0  # bounds a wait for something that must happen; never a claim about how fast it happens


async def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + GENEROUS_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def upstream_saw_client_leave(upstream: FakeUpstream) -> bool:
    return await asyncio.to_thread(upstream.client_gone.wait, GENEROUS_S)


async def read_events(url: str, body: dict[str, Any]) -> list[Any]:
    """Every data event of a 200 stream, parsed ("[DONE]" kept as a string). The read timeout turns a gateway
    that waits for ever into a failure instead of a hang."""
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


def contents(events: list[Any]) -> list[str]:
    return [e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e.get("choices")]


# --- redirects (item 2) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_redirect_is_never_followed(
    fake_upstream_factory: Callable[[], FakeUpstream], status: int, kind: str, stream: bool
) -> None:
    origin, elsewhere = fake_upstream_factory(), fake_upstream_factory()
    origin.behave(mode="redirect", status=status, location=elsewhere.base_url + "/chat/completions")
    app = build_app(single_model(origin, type=kind, router={"num_retries": 0}))
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=STREAM if stream else CHAT, headers=AUTH)
    # Neither the prompt nor the upstream credentials (x-api-key for `anthropic`) reached the other origin.
    assert [dict(r.headers) for r in elsewhere.requests] == []
    assert len(origin.requests) == 1
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_error" and f"HTTP {status}" in error["message"]
    assert "127.0.0.1" not in response.text and str(elsewhere.port) not in response.text


async def test_health_probe_does_not_follow_a_redirect(fake_upstream_factory: Callable[[], FakeUpstream]) -> None:
    origin, elsewhere = fake_upstream_factory(), fake_upstream_factory()
    origin.behave(mode="redirect", status=302, location=elsewhere.base_url + "/models")
    backend = OpenAIBackend("d#0", base_url=origin.base_url, api_key="sk-upstream-SECRET-123")
    try:
        assert await backend.check_health() is False  # every request would fail: not ready
    finally:
        await backend.aclose()
    assert elsewhere.requests == []


# --- size caps (item 3) ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "size"),
    [("", 4 * MiB), ("chunked", 4 * MiB), ("gzip", 48 * MiB)],  # gzip: ~50 KB on the wire, 48 MiB inflated
)
async def test_response_body_over_the_cap_is_502(fake_upstream: FakeUpstream, variant: str, size: int) -> None:
    fake_upstream.behave(mode="huge", variant=variant, size=size)
    app = build_app(single_model(fake_upstream, router={"num_retries": 0}), max_upstream_response_bytes=MiB)
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 502, response.text[:200]
    error = response.json()["error"]
    assert error["code"] == "upstream_malformed_response" and f"limit of {MiB} bytes" in error["message"]


@pytest.mark.parametrize("variant", ["", "chunked", "gzip"])
async def test_response_body_under_the_cap_passes(fake_upstream: FakeUpstream, variant: str) -> None:
    fake_upstream.behave(mode="huge", variant=variant, size=MiB // 2)
    app = build_app(single_model(fake_upstream), max_upstream_response_bytes=MiB)
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status_code == 200
    assert len(response.json()["choices"][0]["message"]["content"]) == MiB // 2


async def test_sse_event_over_the_cap_ends_a_started_stream_with_an_error(
    gateway_server: Any, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.behave(mode="sse_huge", cut_after=2, size=4 * MiB, hold_s=GENEROUS_S)
    server = gateway_server(build_app(single_model(fake_upstream), max_sse_event_bytes=MiB))
    events = await read_events(server.url, STREAM)
    assert contents(events[:2]) == ["", "t0 "]
    assert events[-2]["error"]["code"] == "upstream_malformed_response" and events[-1] == "[DONE]"
    assert await upstream_saw_client_leave(fake_upstream)  # the gateway dropped the upstream connection


async def test_sse_event_over_the_cap_before_the_first_event_is_502(
    gateway_server: Any, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.behave(mode="sse_huge", cut_after=0, size=4 * MiB, hold_s=GENEROUS_S)
    server = gateway_server(build_app(single_model(fake_upstream), max_sse_event_bytes=MiB))
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        response = await client.post("/v1/chat/completions", json=STREAM, headers=AUTH)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_malformed_response"


def test_sse_decoder_caps_an_unfinished_line_and_an_event() -> None:
    line = SSEDecoder(max_event_bytes=1000)
    assert line.feed(b"data: " + b"a" * 500) == []
    with pytest.raises(BackendError) as caught:
        line.feed(b"a" * 600)  # still no newline: 1,100 bytes buffered
    assert caught.value.code == "upstream_malformed_response"
    event = SSEDecoder(max_event_bytes=1000)
    with pytest.raises(BackendError):
        event.feed(b"data: " + b"b" * 400 + b"\n" + b"data: " + b"c" * 400 + b"\n" + b"data: " + b"d" * 400 + b"\n")
    comments = SSEDecoder(max_event_bytes=1000)  # many small lines that are not data never add up
    assert comments.feed(b": keep-alive\n\n" * 1000) == []


_DATA = st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"").lstrip(b" "))
_EVENTS = st.lists(st.tuples(st.sampled_from(["", "ping", "message_stop"]), _DATA), max_size=8)


@settings(max_examples=150, deadline=None)
@given(events=_EVENTS, cuts=st.lists(st.integers(min_value=0, max_value=1_000), max_size=12), cap=st.integers(1, 120))
def test_sse_decoder_split_anywhere_decodes_the_same_within_the_cap(
    events: list[tuple[str, bytes]], cuts: list[int], cap: int
) -> None:
    """However the network splits a stream: within the cap, the events a reference reads; an event whose data
    exceeds the cap always raises; in between (a long `event:` or comment line split mid-way counts) either."""
    stream = b"".join(
        (b"event: " + name.encode() + b"\n" if name else b"") + b": comment\ndata: " + data + b"\n\n"
        for name, data in events
    )
    # The reference: a line's one trailing CR belongs to its CRLF ending.
    expected = [(name or "message", data[:-1] if data.endswith(b"\r") else data) for name, data in events]
    longest_line = max((len(line) for line in stream.split(b"\n")), default=0)
    longest_data = max((len(data) for _, data in expected), default=0)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    decoder = SSEDecoder(max_event_bytes=cap)
    decoded: list[tuple[str, bytes]] = []
    try:
        for start, end in itertools.pairwise(bounds):
            decoded.extend(decoder.feed(stream[start:end]))
        decoded.extend(decoder.flush())
    except BackendError:
        assert cap < longest_line
        return
    assert longest_data <= cap
    assert decoded == expected


# --- stream timeouts (item 6) ----------------------------------------------------------------------------------


async def test_stream_without_a_first_event_is_504_and_frees_the_upstream(
    gateway_server: Any, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.behave(mode="sse_comments", cut_after=0, hold_s=GENEROUS_S)  # comments only, for ever
    access = RecordingAccess(master_key=MASTER)
    app = build_app(single_model(fake_upstream, max_in_flight=1), access=access, stream_first_token_timeout_s=0.5)
    server = gateway_server(app)
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
        response = await client.post("/v1/chat/completions", json=STREAM, headers=AUTH)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    assert await upstream_saw_client_leave(fake_upstream)
    assert access.acquired == access.released == ["gpt-test#0"]


async def test_stream_headers_later_than_the_first_event_is_due_are_504(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="slow", ttft_s=GENEROUS_S)  # the headers come after the first event was due
    app = build_app(single_model(fake_upstream), stream_first_token_timeout_s=0.3)
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=STREAM, headers=AUTH)
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout" and "no stream event" in error["message"]


async def test_stream_gone_quiet_ends_with_an_error_event(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="sse_comments", cut_after=2, hold_s=GENEROUS_S)
    access = RecordingAccess(master_key=MASTER)
    app = build_app(single_model(fake_upstream, max_in_flight=1), access=access, stream_idle_timeout_s=0.5)
    events = await read_events(gateway_server(app).url, STREAM)
    assert contents(events[:2]) == ["", "t0 "]
    assert events[-2]["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    assert await upstream_saw_client_leave(fake_upstream)
    await wait_until(lambda: access.acquired == access.released == ["gpt-test#0"])


async def test_a_slow_consumer_is_not_an_idle_upstream(fake_upstream: FakeUpstream) -> None:
    backend = OpenAIBackend("d#0", base_url=fake_upstream.base_url, api_key=None, idle_timeout_s=0.2)
    chunks = []
    try:
        async with aclosing(backend.stream("chat/completions", {**STREAM, "model": "m"}, request_id="r")) as stream:
            async for chunk in stream:
                chunks.append(chunk)
                await asyncio.sleep(0.4)  # the client is slow; the upstream sent everything long ago
    finally:
        await backend.aclose()
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["", "t0 ", "t1 ", "t2 ", None]


# --- client disconnects before the first byte (item 6) ---------------------------------------------------------


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def family_body(family: str, stream: bool) -> dict[str, Any]:
    if family == "responses":
        return {"model": "gpt-test", "input": "Hello there", "stream": stream}
    return {**CHAT, "max_tokens": 16, "stream": stream}


@pytest.mark.parametrize("family", ["chat", "messages", "responses"])
@pytest.mark.parametrize("stream", [True, False])
async def test_client_gone_before_the_first_byte_cancels_the_upstream_call(
    gateway_server: Any, fake_upstream: FakeUpstream, stream: bool, family: str
) -> None:
    # Streaming: SSE comments only (no first event for minutes); non-streaming: a long generation.
    fake_upstream.behave(mode="sse_comments" if stream else "hang", cut_after=0, hold_s=120)
    access = RecordingAccess(master_key=MASTER)
    server = gateway_server(build_app(single_model(fake_upstream, max_in_flight=1), access=access))
    body = orjson.dumps(family_body(family, stream))
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n" % PATHS[family].encode()
        + b"authorization: Bearer "
        + MASTER.encode()
        + b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await wait_until(lambda: len(fake_upstream.requests) == 1)
    writer.close()  # the client gives up while the gateway still waits for the upstream
    await writer.wait_closed()
    assert await upstream_saw_client_leave(fake_upstream)
    await wait_until(lambda: access.released == ["gpt-test#0"] and len(access.settled) == 1)
    assert access.acquired == ["gpt-test#0"]
