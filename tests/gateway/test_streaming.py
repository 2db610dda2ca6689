"""Streaming through a real uvicorn gateway: order, usage capture/stripping, broken streams, disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from fakes.access import RecordingAccess, Settled
from fakes.app import AUTH, CHAT, MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import PROMPT_TOKENS, Behavior, FakeUpstream

STREAM = {**CHAT, "stream": True}


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def start(gateway_server: Any, upstream: FakeUpstream, **extra: Any) -> tuple[ThreadedServer, RecordingAccess]:
    access = RecordingAccess(master_key=MASTER)
    return gateway_server(build_app(single_model(upstream, **extra), access=access)), access


async def read_events(
    url: str,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
    *,
    on_event: Callable[[list[Any]], None] | None = None,
) -> list[Any]:
    """Every data event, parsed (the literal "[DONE]" kept as a string); `on_event(events so far)` after each."""
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        async with client.stream("POST", path, json=body, headers=AUTH) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else orjson.loads(data))
                    if on_event is not None:
                        on_event(events)
    return events


def contents(events: list[Any]) -> list[str]:
    return [e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e.get("choices")]


async def test_chunks_in_order_usage_captured_and_stripped(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    server, access = start(gateway_server, fake_upstream)
    events = await read_events(server.url, STREAM)
    assert contents(events) == ["", "t0 ", "t1 ", "t2 ", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"
    assert not any("usage" in e for e in events if isinstance(e, dict))  # the client did not ask
    upstream_body = fake_upstream.requests[0].body
    assert upstream_body["stream_options"] == {"include_usage": True}  # but the gateway did, for accounting
    await wait_until(lambda: len(access.settled) == 1)
    assert access.settled == [Settled("gpt-test", PROMPT_TOKENS, 3)]


async def test_usage_chunk_kept_when_client_asks(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    server, access = start(gateway_server, fake_upstream)
    events = await read_events(server.url, {**STREAM, "stream_options": {"include_usage": True}})
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    await wait_until(lambda: len(access.settled) == 1)
    assert access.settled[0].prompt_tokens == PROMPT_TOKENS


async def test_completions_stream(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    server, _ = start(gateway_server, fake_upstream)
    body = {"model": "fast", "prompt": "Once", "stream": True}
    events = await read_events(server.url, body, "/v1/completions")
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["t0 ", "t1 ", "t2 ", ""]
    assert fake_upstream.requests[0].path == "/v1/completions"


@pytest.mark.parametrize(
    ("behavior", "code"),
    [
        (Behavior(mode="stream_cut", cut_after=2), "upstream_error"),
        (Behavior(mode="malformed_chunk", cut_after=2, variant="not_json"), "upstream_malformed_response"),
        (Behavior(mode="malformed_chunk", cut_after=2, variant="no_delta"), "upstream_malformed_response"),
        (Behavior(mode="malformed_chunk", cut_after=2, variant="choices_not_list"), "upstream_malformed_response"),
        (Behavior(mode="error_chunk", cut_after=2), "upstream_error"),
    ],
)
async def test_broken_stream_ends_with_error_event_then_done(
    gateway_server: Any, fake_upstream: FakeUpstream, behavior: Behavior, code: str
) -> None:
    cut = threading.Event()
    if behavior.mode == "stream_cut":  # break only once the two events before it reached us (fakes/upstream.py)
        behavior = dataclasses.replace(behavior, cut_when=cut)

    def cut_after_two(events: list[Any]) -> None:
        if len(events) >= 2:
            cut.set()

    fake_upstream.behave(behavior)
    server, access = start(gateway_server, fake_upstream)
    events = await read_events(server.url, STREAM, on_event=cut_after_two)
    assert contents(events[:2]) == ["", "t0 "]  # what arrived before the break was forwarded
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == code and error["type"] and error["message"]
    assert len(fake_upstream.requests) == 1  # never retried after bytes reached the client
    await wait_until(lambda: len(access.settled) == 1)


async def test_first_chunk_arrives_before_upstream_finishes(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="slow", inter_token_s=0.3, num_chunks=3)
    server, _ = start(gateway_server, fake_upstream)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=STREAM, headers=AUTH) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: ")
            assert fake_upstream.num_open_streams == 1  # still streaming upstream: nothing was buffered
            rest = [line async for line in lines if line]
    assert rest[-1] == "data: [DONE]"


async def test_client_disconnect_cancels_upstream(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="slow", inter_token_s=0.2, num_chunks=100)
    server, access = start(gateway_server, fake_upstream)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        async with client.stream("POST", "/v1/chat/completions", json=STREAM, headers=AUTH) as response:
            async for line in response.aiter_lines():
                if "t0 " in line:
                    break
            assert fake_upstream.num_open_streams == 1
    # The client is gone: the gateway must close its upstream stream, release the deployment and settle.
    await wait_until(lambda: fake_upstream.num_streams_aborted == 1 and fake_upstream.num_open_streams == 0)
    await wait_until(lambda: len(access.settled) == 1)
    assert fake_upstream.num_streams_completed == 0
    assert access.settled[0].completion_tokens >= 1  # estimated from what was streamed (no usage arrived)


async def test_stream_failure_before_first_byte_is_a_plain_http_error(
    gateway_server: Any, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.behave(mode="status", status=401)
    server, access = start(gateway_server, fake_upstream, router={"num_retries": 0})
    async with httpx.AsyncClient(base_url=server.url) as client:
        response = await client.post("/v1/chat/completions", json=STREAM, headers=AUTH)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_auth_failed"
    assert len(access.settled) == 1 and access.settled[0].completion_tokens == 0


async def test_stream_retried_before_first_byte(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    fake_upstream.queue(Behavior(mode="status", status=500), Behavior(mode="drop"))
    server, _ = start(gateway_server, fake_upstream, router={"num_retries": 2, "retry_backoff_s": 0.001})
    events = await read_events(server.url, STREAM)
    assert contents(events) == ["", "t0 ", "t1 ", "t2 ", ""]
    assert len(fake_upstream.requests) == 3
