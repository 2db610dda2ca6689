"""The official OpenAI Python SDK talking to the gateway under uvicorn (streaming and not)."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
from fakes.access import RecordingAccess
from fakes.app import MASTER, build_app, single_model
from fakes.upstream import FakeUpstream


def sdk(gateway_server: Any, upstream: FakeUpstream, *, base_path: str = "/v1") -> openai.AsyncOpenAI:
    server = gateway_server(build_app(single_model(upstream), access=RecordingAccess(master_key=MASTER)))
    return openai.AsyncOpenAI(base_url=server.url + base_path, api_key=MASTER, max_retries=0)


async def test_sdk_chat_non_streaming_and_streaming(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    client = sdk(gateway_server, fake_upstream)
    messages: Any = [{"role": "user", "content": "Hi"}]
    completion = await client.chat.completions.create(model="fast", messages=messages)
    assert completion.choices[0].message.content == "Hello from the fake upstream"
    assert completion.usage is not None and completion.usage.total_tokens == 10
    stream = await client.chat.completions.create(
        model="gpt-test", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == "t0 t1 t2 "
    assert usage is not None and usage.completion_tokens == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["gpt-test"]
    embedding = await client.embeddings.create(model="fast", input="x")
    assert embedding.data[0].embedding == [0.1, 0.2, 0.3]
    await client.close()


async def test_sdk_sees_typed_errors(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    client = sdk(gateway_server, fake_upstream)
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="gpt-tset", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    fake_upstream.behave(mode="status", status=429, retry_after="3")
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "x"}])
    assert limited.value.response.headers["retry-after"] == "3"
    bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="sk-ug-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await client.close()
    await bad.close()


async def test_sdk_stream_error_event_raises(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    # The upstream breaks only once the stream is under way: cut at once, the close can swallow every chunk before
    # the gateway reads the first, and `create` then gets a plain 502 (see `stream_cut` in fakes/upstream.py).
    cut = threading.Event()
    fake_upstream.behave(mode="stream_cut", cut_after=2, cut_when=cut)
    client = sdk(gateway_server, fake_upstream)
    stream = await client.chat.completions.create(
        model="fast", messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(openai.APIError, match=r"ended|closed"):
        async for _ in stream:
            cut.set()
    await client.close()


async def test_sdk_with_doubled_v1_base_url(gateway_server: Any, fake_upstream: FakeUpstream) -> None:
    client = sdk(gateway_server, fake_upstream, base_path="/v1/v1")
    completion = await client.chat.completions.create(model="fast", messages=[{"role": "user", "content": "Hi"}])
    assert completion.choices[0].message.content
    await client.close()
