"""AnthropicBackend against a fake Anthropic server on loopback: passthrough, translation, error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakes.anthropic_upstream import UPSTREAM_KEY, FakeAnthropic, LoopbackServer
from fakes.net import free_port
from fakes.streams import collect

from backends.anthropic import AnthropicBackend
from backends.base import Backend
from gateway.errors import (
    BackendError,
    InvalidRequestError,
    UpstreamRateLimitedError,
    UpstreamTimeoutError,
)

MESSAGES_BODY = {"max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}]}
CHAT_BODY = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeAnthropic, str]]:
    upstream = FakeAnthropic()
    async with LoopbackServer(upstream.app(), free_port()) as server:
        yield upstream, server.url


@pytest.fixture
async def backend(fake: tuple[FakeAnthropic, str]) -> AsyncIterator[AnthropicBackend]:
    backend = AnthropicBackend("claude#0", base_url=fake[1] + "/v1", api_key=UPSTREAM_KEY, timeout_s=2.0)
    yield backend
    await backend.aclose()


def test_is_a_backend() -> None:
    backend = AnthropicBackend("claude#0", base_url="http://127.0.0.1:9/v1", api_key="k")
    assert isinstance(backend, Backend)
    assert [backend.supports(e) for e in ("messages", "messages/count_tokens", "chat/completions", "embeddings")] == [
        True,
        True,
        True,
        False,
    ]


async def test_messages_passthrough_sends_the_upstream_key_and_version(
    fake: tuple[FakeAnthropic, str], backend: AnthropicBackend
) -> None:
    message = await backend.send("messages", {**MESSAGES_BODY, "model": "claude-ok"}, request_id="req-1")
    assert message["content"] == [{"type": "text", "text": "Hello from fake"}]
    recorded = fake[0].requests[-1]
    assert recorded.headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in recorded.headers
    assert recorded.headers["anthropic-version"] == "2023-06-01"
    assert recorded.headers["x-request-id"] == "req-1"
    assert recorded.body == {**MESSAGES_BODY, "model": "claude-ok"}


async def test_count_tokens(backend: AnthropicBackend) -> None:
    counted = await backend.send("messages/count_tokens", {**MESSAGES_BODY, "model": "claude-ok"}, request_id="r")
    assert counted["input_tokens"] > 0


async def test_messages_stream_yields_events_without_pings(backend: AnthropicBackend) -> None:
    events = await collect(backend.stream("messages", {**MESSAGES_BODY, "model": "claude-tool"}, request_id="r"))
    types = [event["type"] for event in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and "ping" not in types
    assert [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"] == [
        '{"city": ',
        '"Paris"}',
    ]


async def test_chat_completions_are_translated_both_ways(
    fake: tuple[FakeAnthropic, str], backend: AnthropicBackend
) -> None:
    completion = await backend.send("chat/completions", {**CHAT_BODY, "model": "claude-tool"}, request_id="r")
    sent = fake[0].requests[-1].body
    assert sent["system"] == "Be brief." and sent["max_tokens"] == 4096
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Hello from fake"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city":"Paris"}'}
    assert completion["usage"]["prompt_tokens"] == 11 and completion["usage"]["completion_tokens"] == 5


async def test_chat_completions_stream(backend: AnthropicBackend) -> None:
    chunks = await collect(
        backend.stream("chat/completions", {**CHAT_BODY, "model": "claude-tool", "stream": True}, request_id="r")
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello from fake"
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_unsupported_endpoint(backend: AnthropicBackend) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        await backend.send("embeddings", {"input": "x", "model": "claude-ok"}, request_id="r")
    assert caught.value.code == "unsupported_endpoint"


@pytest.mark.parametrize(
    ("model", "error_class", "code", "status"),
    [
        ("claude-429", UpstreamRateLimitedError, "upstream_rate_limited", 429),
        ("claude-400", InvalidRequestError, "invalid_request", 400),
        ("claude-500", BackendError, "upstream_error", 502),
        ("claude-529", BackendError, "upstream_overloaded", 503),
        ("claude-html", BackendError, "upstream_malformed_response", 502),
        ("claude-slow", UpstreamTimeoutError, "upstream_timeout", 504),
    ],
)
async def test_upstream_failures_map_to_gateway_errors(
    fake: tuple[FakeAnthropic, str], model: str, error_class: type[Exception], code: str, status: int
) -> None:
    backend = AnthropicBackend("claude#0", base_url=fake[1] + "/v1", api_key=UPSTREAM_KEY, timeout_s=0.5)
    try:
        for call in (
            backend.send("messages", {**MESSAGES_BODY, "model": model}, request_id="r"),
            _first(backend, model),
        ):
            with pytest.raises(error_class) as caught:
                await call
            error: Any = caught.value
            assert (error.code, error.status_code) == (code, status)
            assert "127.0.0.1" not in error.message and UPSTREAM_KEY not in error.message
            if model == "claude-429":
                assert error.headers == {"retry-after": "7"}
    finally:
        await backend.aclose()


async def _first(backend: AnthropicBackend, model: str) -> None:
    await collect(backend.stream("messages", {**MESSAGES_BODY, "model": model}, request_id="r"))


async def test_wrong_upstream_key_is_upstream_auth_failed(fake: tuple[FakeAnthropic, str]) -> None:
    backend = AnthropicBackend("claude#0", base_url=fake[1] + "/v1", api_key="wrong-key-123456")
    try:
        with pytest.raises(BackendError) as caught:
            await backend.send("messages", {**MESSAGES_BODY, "model": "claude-ok"}, request_id="r")
        assert (caught.value.code, caught.value.status_code) == ("upstream_auth_failed", 502)
        assert "wrong-key" not in caught.value.message
    finally:
        await backend.aclose()


async def test_unreachable_upstream() -> None:
    backend = AnthropicBackend("claude#0", base_url=f"http://127.0.0.1:{free_port()}/v1", api_key=UPSTREAM_KEY)
    try:
        with pytest.raises(BackendError) as caught:
            await backend.send("messages", {**MESSAGES_BODY, "model": "claude-ok"}, request_id="r")
        assert caught.value.code == "upstream_unreachable"
        assert await backend.check_health() is False
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("model", "error_class", "message"),
    [
        ("claude-cut", BackendError, "ended before"),
        ("claude-reset", BackendError, "middle of the stream"),
        ("claude-error", BackendError, "is overloaded in the middle of the stream"),  # its own text: logged only
    ],
)
async def test_stream_breaking_mid_way(
    fake: tuple[FakeAnthropic, str], backend: AnthropicBackend, model: str, error_class: type[Exception], message: str
) -> None:
    fake[0].break_when = asyncio.Event()
    received: list[dict[str, Any]] = []
    with pytest.raises(error_class, match=message):
        async for event in backend.stream("messages", {**MESSAGES_BODY, "model": model}, request_id="r"):
            received.append(event)
            if len(received) == 2:
                fake[0].break_when.set()
    assert [e["type"] for e in received][:2] == ["message_start", "content_block_start"]


async def test_health(backend: AnthropicBackend) -> None:
    assert await backend.check_health() is True
