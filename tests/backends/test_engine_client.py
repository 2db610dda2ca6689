"""`EngineClient` against the real engine host (`gateway.engine_host.host.EngineHost`) over a real Unix socket:
what the engine sends comes back unchanged, its errors come back as the same gateway errors, a missing engine is a
503 at once, and closing a stream early aborts its request in the engine. The host serves a fake backend with
canned answers, a tiny real model, or a model that fails to load; a raw server stands in for a host that dies
mid-stream or answers garbage."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.engine_host import tiny_local_backend

from backends.base import MAX_TOKENS_CLAMPED_KEY, Endpoint, HealthState, Json, OutputLimits
from backends.config import LocalModelOptions
from backends.engine_client import EngineClient, EngineClientConfig
from backends.engine_protocol import Output, encode, read_message
from gateway.engine_host.host import EngineHost, HostedBackend
from gateway.engine_host.main import bind_owner_only
from gateway.errors import EngineError, EngineLoadingError, InvalidRequestError, UnavailableError

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
LAST = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
LOADING = EngineLoadingError("The local model is still loading.", headers={"retry-after": "5"})


class FakeBackend:
    """The local backend's calls with canned answers; `mode` in the request body picks one."""

    def __init__(self) -> None:
        self.state: HealthState = "loading"
        self.context_length: int | None = None
        self.engine_stats: dict[str, Any] = {}
        self.stream_closed = asyncio.Event()

    async def send(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> Json:
        if body.get("mode") == "refused":
            raise InvalidRequestError("temperature must be >= 0", param="temperature")
        return {"id": "r1", "choices": [], MAX_TOKENS_CLAMPED_KEY: [100, 50]}

    async def stream(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> AsyncIterator[Json]:
        mode = body.get("mode")
        if mode == "loading":
            raise LOADING
        try:
            yield CHUNK
            if mode == "error":
                raise EngineError("The local engine failed: boom")
            if mode == "slow":
                await asyncio.sleep(30)
            yield LAST
        finally:
            self.stream_closed.set()

    async def count_prompt_tokens(self, body: Json) -> int:
        return 17

    def health_state(self) -> HealthState:
        return self.state

    def output_limits(self) -> OutputLimits:
        return OutputLimits(self.context_length, True, None)

    def stats(self) -> dict[str, Any]:
        return self.engine_stats


async def start_host(backend: HostedBackend, path: Path) -> EngineHost:
    host = EngineHost(backend)
    await host.start(bind_owner_only(path))
    return host


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[tuple[FakeBackend, EngineHost, str]]:
    fake = FakeBackend()
    host = await start_host(fake, tmp_path / "engine.sock")
    yield fake, host, str(tmp_path / "engine.sock")
    await host.shutdown(0)


def client_for(socket_path: str, **options: Any) -> EngineClient:
    return EngineClient(EngineClientConfig("local#0", socket_path=socket_path, poll_interval_s=60, **options))


async def collect(client: EngineClient, **body: Any) -> list[dict[str, Any]]:
    return [chunk async for chunk in client.stream("chat/completions", body, request_id="req-1")]


async def test_responses_and_chunks_come_back_as_the_engine_sent_them(engine: Any) -> None:
    client = client_for(engine[2])
    try:
        response = await client.send("chat/completions", {}, request_id="req-1")
        assert response[MAX_TOKENS_CLAMPED_KEY] == [100, 50]  # the gateway turns it into the clamp header
        assert await collect(client) == [CHUNK, LAST]
        assert await collect(client) == [CHUNK, LAST]  # on the connection the first stream gave back
        assert await client.count_prompt_tokens({"messages": []}) == 17
        results = await asyncio.gather(*(collect(client) for _ in range(8)))  # a connection each, at once
        assert results == [[CHUNK, LAST]] * 8
    finally:
        await client.aclose()


async def test_engine_errors_come_back_as_the_same_gateway_errors(engine: Any) -> None:
    client = client_for(engine[2])
    try:
        with pytest.raises(EngineLoadingError) as loading:
            await collect(client, mode="loading")
        assert (loading.value.status_code, loading.value.headers) == (503, {"retry-after": "5"})
        with pytest.raises(InvalidRequestError) as refused:
            await client.send("chat/completions", {"mode": "refused"}, request_id="req-1")
        assert (refused.value.status_code, refused.value.param) == (400, "temperature")
        chunks: list[Json] = []
        with pytest.raises(EngineError) as failed:
            async for chunk in client.stream("chat/completions", {"mode": "error"}, request_id="req-1"):
                chunks.append(chunk)
        assert chunks == [CHUNK] and (failed.value.status_code, failed.value.code) == (500, "engine_error")
        assert await collect(client) == [CHUNK, LAST]  # and the connections stay good
    finally:
        await client.aclose()


async def test_closing_a_stream_early_aborts_it_in_the_engine(engine: Any) -> None:
    fake, host, path = engine
    client = client_for(path)
    try:
        stream = client.stream("chat/completions", {"mode": "slow"}, request_id="req-1")
        assert await anext(stream) == CHUNK
        await stream.aclose()  # type: ignore[attr-defined]
        await asyncio.wait_for(fake.stream_closed.wait(), 5)
        assert host.num_calls() == 0
        assert await collect(client) == [CHUNK, LAST]
    finally:
        await client.aclose()


async def test_state_stats_and_limits_are_the_engines_last_answer(engine: Any) -> None:
    fake, _, path = engine
    client = client_for(path, model=LocalModelOptions(default_max_tokens=0), clamp_max_tokens=False)
    try:
        await client.refresh()
        assert client.health_state() == "loading" and client.stats()["loaded"] is False
        assert client.output_limits() == OutputLimits(None, False, None)
        fake.state, fake.context_length = "up", 4096
        fake.engine_stats = {"name": "engine-side#0", "loaded": True, "num_running_seqs": 0, "max_model_len": 4096}
        await client.refresh()
        assert client.health_state() == "up" and await client.check_health()
        stats = client.stats()
        assert (stats["name"], stats["pid"], stats["loaded"], stats["state"]) == ("local#0", os.getpid(), True, "up")
        assert client.output_limits().context_length == 4096
    finally:
        await client.aclose()


async def test_a_socket_nobody_listens_on_is_a_503_at_once(tmp_path: Path) -> None:
    client = client_for(str(tmp_path / "nobody.sock"))
    try:
        for call in (
            client.send("chat/completions", {}, request_id="req-1"),
            collect(client),
            client.count_prompt_tokens({}),
        ):
            with pytest.raises(UnavailableError) as info:
                await asyncio.wait_for(call, 5)
            assert (info.value.status_code, info.value.code) == (503, "engine_error")
            assert info.value.headers["retry-after"] == "5"
        await client.refresh()
        assert client.health_state() == "down" and client.stats()["loaded"] is False
    finally:
        await client.aclose()


Script = Callable[[int, asyncio.StreamWriter], Awaitable[None]]


async def raw_host(path: Path, script: Script) -> asyncio.Server:
    """A server that reads the first call, then answers as `script` says (a host dying, or babbling)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        message = await read_message(reader)
        assert message is not None
        await script(message.call_id, writer)
        writer.close()

    return await asyncio.start_unix_server(handle, path=str(path))


async def one_chunk_then_gone(call_id: int, writer: asyncio.StreamWriter) -> None:
    writer.write(encode(Output(call_id, CHUNK)))


async def gone(call_id: int, writer: asyncio.StreamWriter) -> None:
    pass


async def half_a_frame(call_id: int, writer: asyncio.StreamWriter) -> None:
    writer.write(encode(Output(call_id, CHUNK))[:20])


async def garbage(call_id: int, writer: asyncio.StreamWriter) -> None:
    writer.write(struct.pack(">I", 5) + b"hello")


async def oversize(call_id: int, writer: asyncio.StreamWriter) -> None:
    writer.write(struct.pack(">I", 2**31))


async def test_a_host_gone_mid_stream_is_a_503_and_one_that_babbles_a_502(tmp_path: Path) -> None:
    path = tmp_path / "raw.sock"
    server = await raw_host(path, one_chunk_then_gone)
    client = client_for(str(path))
    try:
        chunks: list[Json] = []
        with pytest.raises(UnavailableError) as cut:
            async for chunk in client.stream("chat/completions", {}, request_id="req-1"):
                chunks.append(chunk)
        assert chunks == [CHUNK] and cut.value.status_code == 503 and "middle of the stream" in cut.value.message
        assert client.health_state() == "down"
        for script in (gone, half_a_frame):  # gone before its first message
            server.close()
            server = await raw_host(path, script)
            with pytest.raises(UnavailableError, match="is not running"):
                await client.send("chat/completions", {}, request_id="req-1")
        for script in (garbage, oversize):
            server.close()
            server = await raw_host(path, script)
            with pytest.raises(EngineError) as babbled:
                await asyncio.wait_for(client.send("chat/completions", {}, request_id="req-1"), 5)
            assert babbled.value.status_code == 502 and "engine protocol" in babbled.value.message
    finally:
        server.close()
        await client.aclose()


async def test_a_tiny_model_through_the_host(tmp_path: Path) -> None:
    """The real local backend behind the host: the same answer streamed or not, its exact prompt count, and a
    stream closed early is aborted in the engine (its sequence freed)."""
    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny", max_position_embeddings=4096)  # a stream to cut short
    backend = tiny_local_backend(checkpoint, tmp_path / "cache")
    host = await start_host(backend, tmp_path / "engine.sock")
    client = client_for(str(tmp_path / "engine.sock"))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    try:
        sent = await client.send("chat/completions", body, request_id="req-1")
        chunks = await collect(client, **body, stream_options={"include_usage": True})
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert streamed == sent["choices"][0]["message"]["content"]
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (sent["usage"]["prompt_tokens"], 6)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the engine's prefix cache, seen through
        assert await client.count_prompt_tokens(body) == sent["usage"]["prompt_tokens"]
        stream = client.stream("chat/completions", {**body, "max_tokens": 4000, "ignore_eos": True}, request_id="r2")
        await anext(stream)
        assert backend.stats()["num_running_seqs"] == 1
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if backend.stats()["num_running_seqs"] == 0 and host.num_calls() == 0:
                break
            await asyncio.sleep(0.01)
        assert backend.stats()["num_running_seqs"] == 0
    finally:
        await client.aclose()
        await host.shutdown(0)
        await backend.aclose()


async def test_a_failed_load_in_the_engine_process_is_reported_with_its_code(tmp_path: Path) -> None:
    """The real host with a `model_path` that does not exist: its client reports the engine's own `load_failed` and
    code (readiness and the console show them), not a process that did not answer; once the host is gone, nothing
    of that stale answer is reported."""
    from gateway.health_probe import _load_error as load_failure

    backend = tiny_local_backend(tmp_path / "no-such-model", tmp_path / "cache")
    host = await start_host(backend, tmp_path / "engine.sock")
    client = client_for(str(tmp_path / "engine.sock"))
    try:
        for _ in range(200):  # the load fails at once (nothing to read); bounded wait for the engine to say so
            await client.refresh()
            if client.health_state() == "down":
                break
            await asyncio.sleep(0.05)
        stats = client.stats()
        assert (client.health_state(), stats["load_failed"], stats["load_error"]) == (
            "down",
            True,
            "checkpoint_not_found",
        )
        assert load_failure(client) == "checkpoint_not_found"
        await host.shutdown(0)
        await client.refresh()  # the host has stopped
        assert client.health_state() == "down" and client.stats()["load_failed"] is False
    finally:
        await client.aclose()
        await host.shutdown(0)
        await backend.aclose()
