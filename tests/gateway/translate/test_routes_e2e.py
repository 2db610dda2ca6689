"""The official `anthropic` and `openai` SDKs against a real gateway on loopback, routed to a fake
OpenAI-compatible upstream, a fake tool-calling upstream and a fake Anthropic upstream."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from fake_chat_tools import FakeChatTools
from fakes.anthropic_upstream import UPSTREAM_KEY, FakeAnthropic
from fakes.server import ThreadedServer
from fakes.upstream import Behavior, FakeUpstream

from gateway.app import create_app
from gateway.routes.anthropic import anthropic_headers, anthropic_model_list
from gateway.routing_config import parse_routing
from gateway.settings import Settings

MASTER_KEY = "sk-ug-master-test"
WEATHER_TOOL = {
    "name": "weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@dataclass
class Stack:
    url: str
    upstream: FakeUpstream
    tools: FakeChatTools
    claude: FakeAnthropic


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    upstream = FakeUpstream().start()
    tools, claude = FakeChatTools(), FakeAnthropic()
    tools_server = ThreadedServer(tools.app(), lifespan="off").start()
    claude_server = ThreadedServer(claude.app(), lifespan="off").start()

    def anthropic_model(name: str) -> dict[str, Any]:
        deployment = {
            "type": "anthropic",
            "base_url": claude_server.url + "/v1",
            "api_key": UPSTREAM_KEY,
            "model": name,
        }
        return {"id": name, "deployments": [deployment]}

    routing = parse_routing(
        {
            "models": [
                {
                    "id": "gpt-fake",
                    "deployments": [{"type": "openai", "base_url": upstream.base_url, "api_key": "up-key"}],
                },
                {"id": "gpt-tools", "deployments": [{"type": "openai", "base_url": tools_server.url + "/v1"}]},
                anthropic_model("claude-ok"),
                anthropic_model("claude-tool"),
                anthropic_model("claude-error"),
            ],
            "router": {"num_retries": 0},
        },
        source="test",
    )
    settings = Settings(_env_file=None, master_key=MASTER_KEY, health_probe_interval_s=0)  # type: ignore[call-arg]
    app = create_app(settings, routing=routing)
    gateway = ThreadedServer(app).start()
    try:
        yield Stack(gateway.url, upstream, tools, claude)
    finally:
        for server in (gateway, tools_server, claude_server):
            server.stop()
        upstream.stop()


@pytest.fixture(autouse=True)
def _reset(stack: Stack) -> None:
    stack.upstream.reset()


def _claude(stack: Stack, *, suffix: str = "", **options: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=stack.url + suffix, api_key=MASTER_KEY, max_retries=0, **options)


def _openai(stack: Stack, *, suffix: str = "/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + suffix, api_key=MASTER_KEY, max_retries=0)


def _sse_names(raw: bytes) -> list[str]:
    return [line[7:] for line in raw.decode().splitlines() if line.startswith("event: ")]


def _sse_data(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


# ---------------------------------------------------------------- Anthropic SDK on a chat-completions upstream


@pytest.mark.parametrize("suffix", ["", "/v1"])  # Claude Code with and without /v1 in ANTHROPIC_BASE_URL
async def test_messages_translated_to_chat(stack: Stack, suffix: str) -> None:
    async with _claude(stack, suffix=suffix) as client:
        response = await client.messages.with_raw_response.create(
            model="gpt-fake",
            max_tokens=64,
            system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Hi"}],
            metadata={"user_id": "u-1"},
        )
    message = await response.parse()
    assert message.content[0].type == "text" and message.content[0].text == "Hello from the fake upstream"
    assert (message.model, message.stop_reason, message.usage.output_tokens) == ("gpt-fake", "end_turn", 3)
    assert response.headers["request-id"]
    sent = stack.upstream.requests[-1]
    assert sent.path == "/v1/chat/completions" and sent.headers["authorization"] == "Bearer up-key"
    assert sent.body["messages"][0] == {"role": "system", "content": "Be brief."}


async def test_messages_stream_translated_to_chat(stack: Stack) -> None:
    async with _claude(stack) as client:
        async with client.messages.stream(
            model="gpt-fake", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            message = await stream.get_final_message()
    assert text == "t0 t1 t2 "
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3 and message.usage.input_tokens > 0


async def test_messages_tool_use_both_ways(stack: Stack) -> None:
    async with _claude(stack) as client:
        message = await client.messages.create(
            model="gpt-tools",
            max_tokens=64,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "Weather in Paris?"}],
        )
        assert message.stop_reason == "tool_use"
        tool_use = message.content[1]
        assert tool_use.type == "tool_use" and tool_use.input == {"city": "Paris"}
        assert stack.tools.bodies[-1]["tool_choice"] == "required"
        async with client.messages.stream(
            model="gpt-tools",
            max_tokens=64,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": tool_use.id, "name": "weather", "input": {"city": "Paris"}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C"}]},
            ],
        ) as stream:
            final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert stack.tools.bodies[-1]["messages"][-1] == {"role": "tool", "tool_call_id": tool_use.id, "content": "18C"}


async def test_upstream_failure_mid_stream_closes_the_block_then_errors(stack: Stack) -> None:
    # The upstream breaks only once the block's first delta reached us, so a block is open when it does (cut at
    # once, the close can swallow that delta before the gateway reads it: see `stream_cut` in fakes/upstream.py).
    cut = threading.Event()
    stack.upstream.behave(Behavior(mode="stream_cut", cut_after=2, cut_when=cut))
    raw = b""
    async with httpx.AsyncClient(base_url=stack.url) as client:
        body = {"model": "gpt-fake", "max_tokens": 64, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        headers = {"x-api-key": MASTER_KEY}
        async with client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as response:
            async for piece in response.aiter_bytes():
                raw += piece
                if b"event: content_block_delta" in raw:
                    cut.set()
    names = _sse_names(raw)
    assert names[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert names[-2:] == ["content_block_stop", "error"] and "message_stop" not in names
    assert _sse_data(raw)[-1]["error"]["type"] == "api_error"


# ---------------------------------------------------------------- Anthropic SDK on an Anthropic upstream


async def test_native_passthrough_replaces_the_key(stack: Stack) -> None:
    async with _claude(stack, default_headers={"anthropic-beta": "made-up-beta-2099"}) as client:
        message = await client.messages.create(
            model="claude-tool", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        )
        async with client.messages.stream(
            model="claude-tool", max_tokens=64, messages=[{"role": "user", "content": "Hi"}]
        ) as stream:
            final = await stream.get_final_message()
    assert message.stop_reason == "tool_use" and message.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert final.content[1].input == {"city": "Paris"} and final.usage.output_tokens == 5  # type: ignore[union-attr]
    recorded = stack.claude.requests[-1]
    assert recorded.headers["x-api-key"] == UPSTREAM_KEY and MASTER_KEY not in str(recorded.headers)
    assert "stream_options" not in recorded.body and recorded.body["model"] == "claude-tool"
    # The client's beta flags change what a Messages body may hold: passed on, streamed or not.
    assert [r.headers.get("anthropic-beta") for r in stack.claude.requests[-2:]] == ["made-up-beta-2099"] * 2


async def test_native_error_event_closes_open_blocks(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as client:
        body = {
            "model": "claude-error",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "Hi"}],
        }
        response = await client.post("/v1/messages", json=body, headers={"authorization": f"Bearer {MASTER_KEY}"})
    names = _sse_names(response.content)
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "error"]
    assert _sse_data(response.content)[-1]["error"]["type"] == "overloaded_error"


async def test_count_tokens(stack: Stack) -> None:
    async with _claude(stack) as client:
        estimated = await client.messages.count_tokens(
            model="gpt-fake", messages=[{"role": "user", "content": "Hello there"}]
        )
        native = await client.messages.count_tokens(
            model="claude-ok", messages=[{"role": "user", "content": "Hello there"}]
        )
    assert estimated.input_tokens > 0 and native.input_tokens > 0
    assert stack.claude.requests[-1].path == "/v1/messages/count_tokens"
    # An OpenAI upstream cannot count: the gateway's estimate says so; the Anthropic upstream's count is exact.
    assert (estimated.model_extra or {}).get("estimated") is True
    assert "estimated" not in (native.model_extra or {})


async def test_error_envelopes_are_anthropic_shaped(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as client:
        body = {"model": "gpt-fake", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        unauthorised = await client.post("/v1/messages", json=body, headers={"x-api-key": "sk-ug-wrong"})
        unknown = await client.post("/v1/messages", json={**body, "model": "nope"}, headers={"x-api-key": MASTER_KEY})
        invalid = await client.post("/v1/v1/messages", json={**body, "messages": []}, headers={"x-api-key": MASTER_KEY})
    assert unauthorised.status_code == 401
    assert unauthorised.json()["type"] == "error" and unauthorised.json()["error"]["type"] == "authentication_error"
    assert unauthorised.headers["request-id"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "invalid_request_error"
    async with _claude(stack) as sdk:
        with pytest.raises(anthropic.NotFoundError):
            await sdk.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])


# ---------------- OpenAI SDK: Responses, and chat on an Anthropic upstream


@pytest.mark.parametrize("suffix", ["/v1", ""])  # Codex given http://host/v1 or http://host
async def test_responses_translated(stack: Stack, suffix: str) -> None:
    async with _openai(stack, suffix=suffix) as client:
        response = await client.responses.create(model="gpt-fake", input="Hi", instructions="Be brief.", store=False)
    assert response.output_text == "Hello from the fake upstream" and response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert stack.upstream.requests[-1].body["messages"][0] == {"role": "system", "content": "Be brief."}


async def test_responses_stream_with_function_calls(stack: Stack) -> None:
    tool = {"type": "function", "name": "weather", "parameters": WEATHER_TOOL["input_schema"], "strict": False}
    async with _openai(stack) as client:
        async with client.responses.stream(
            model="gpt-tools",
            input=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[tool],  # type: ignore[list-item]
        ) as stream:
            names = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in names
    call = final.output[1]
    assert call.type == "function_call" and call.arguments == '{"city": "Paris"}' and call.name == "weather"
    assert final.usage is not None and final.usage.input_tokens == 21


async def test_responses_stream_failure(stack: Stack) -> None:
    # The upstream breaks only once output reached us: cut at once, the close can swallow every chunk before the
    # gateway reads the first, and the gateway then answers a plain 502 (see `stream_cut` in fakes/upstream.py).
    cut = threading.Event()
    stack.upstream.behave(Behavior(mode="stream_cut", cut_after=2, cut_when=cut))
    raw = b""
    async with httpx.AsyncClient(base_url=stack.url) as client:
        body = {"model": "gpt-fake", "input": "Hi", "stream": True}
        headers = {"authorization": f"Bearer {MASTER_KEY}"}
        async with client.stream("POST", "/responses", json=body, headers=headers) as response:
            async for piece in response.aiter_bytes():
                raw += piece
                if b"event: response.output_text.delta" in raw:
                    cut.set()
    names = _sse_names(raw)
    assert "response.output_text.delta" in names
    assert names[-1] == "response.failed" and "response.completed" not in names
    assert _sse_data(raw)[-1]["response"]["error"]["code"] == "server_error"


async def test_chat_completions_on_an_anthropic_upstream(stack: Stack) -> None:
    async with _openai(stack) as client:
        completion = await client.chat.completions.create(
            model="claude-tool", messages=[{"role": "user", "content": "Hi"}]
        )
        stream = await client.chat.completions.create(
            model="claude-tool", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        chunks = [chunk async for chunk in stream]
    call = completion.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "weather" and orjson.loads(call.function.arguments) == {"city": "Paris"}
    assert completion.choices[0].finish_reason == "tool_calls"
    arguments = "".join(
        tc.function.arguments or ""
        for c in chunks
        if c.choices
        for tc in c.choices[0].delta.tool_calls or []
        if tc.function
    )
    assert orjson.loads(arguments) == {"city": "Paris"}
    assert stack.claude.requests[-1].body["max_tokens"] > 0


# ---------------------------------------------------------------- helpers the core routes can use


def test_anthropic_rate_limit_header_names() -> None:
    headers = {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1m0.5s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "20ms",
    }
    result = anthropic_headers(headers, request_id="req-1", now=1_700_000_000.0)
    assert {k: v for k, v in result.items() if k.startswith("anthropic-")} == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "59",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:14:20Z",
        "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "900",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:20Z",
    }
    assert result["request-id"] == "req-1" and result["x-ratelimit-limit-requests"] == "60"


def test_anthropic_model_list_shape() -> None:
    page = anthropic_model_list(["a", "b"], created=0)
    assert page == {
        "data": [
            {
                "type": "model",
                "id": "a",
                "display_name": "a",
                "created_at": "1970-01-01T00:00:00Z",
                "lifecycle": "active",
            },
            {
                "type": "model",
                "id": "b",
                "display_name": "b",
                "created_at": "1970-01-01T00:00:00Z",
                "lifecycle": "active",
            },
        ],
        "has_more": False,
        "first_id": "a",
        "last_id": "b",
    }
    anthropic.types.ModelInfo.model_validate(page["data"][0])
