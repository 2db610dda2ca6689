"""`EngineClient` against a fake engine server on a real Unix socket: what the engine sends comes back unchanged,
its errors come back as the same gateway errors, a missing engine is a 503 at once, and closing a stream early
closes its connection (the real engine server then aborts the request: tests/test_e2e_workers.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fakes.server import ThreadedServer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backends.base import MAX_TOKENS_CLAMPED_KEY, OutputLimits
from backends.engine_client import EngineClient, EngineClientConfig, engine_error_from
from gateway.engine_server import error_payload
from gateway.errors import EngineError, EngineLoadingError, GatewayError, InvalidRequestError, UnavailableError

CHUNK = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
LAST = {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
LOADING = EngineLoadingError("The local model is still loading.", headers={"retry-after": "5"})


class FakeEngine:
    """The engine protocol with canned answers; `mode` in the request body picks one."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"pid": 4242, "state": "loading", "context_length": None, "stats": {}}
        self.stream_closed = threading.Event()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/engine/state", self.get_state),
                Route("/engine/send/{endpoint:path}", self.send, methods=["POST"]),
                Route("/engine/stream/{endpoint:path}", self.stream, methods=["POST"]),
                Route("/engine/count_tokens", self.count_tokens, methods=["POST"]),
            ]
        )

    async def get_state(self, request: Request) -> Response:
        return JSONResponse(self.state)

    async def send(self, request: Request) -> Response:
        body = await request.json()
        if body.get("mode") == "refused":
            error = InvalidRequestError("temperature must be >= 0", param="temperature")
            return JSONResponse(error_payload(error), status_code=400)
        return JSONResponse({"id": "r1", "choices": [], MAX_TOKENS_CLAMPED_KEY: [100, 50]})

    async def count_tokens(self, request: Request) -> Response:
        return JSONResponse({"num_tokens": 17})

    async def stream(self, request: Request) -> Response:
        mode = (await request.json()).get("mode")
        if mode == "loading":
            return JSONResponse(error_payload(LOADING), status_code=503, headers=LOADING.headers)

        async def events() -> AsyncIterator[bytes]:
            try:
                yield b"data: " + orjson.dumps(CHUNK) + b"\n\n"
                if mode == "error":
                    failure = EngineError("The local engine failed: boom")
                    yield b"data: " + orjson.dumps(error_payload(failure)) + b"\n\ndata: [DONE]\n\n"
                elif mode == "slow":
                    await asyncio.sleep(30)
                elif mode != "cut":
                    yield b"data: " + orjson.dumps(LAST) + b"\n\ndata: [DONE]\n\n"
            finally:
                self.stream_closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    path = tmp_path / "engine.sock"
    with ThreadedServer(fake.app(), uds=str(path)):
        yield fake, str(path)


def client_for(socket_path: str, **options: Any) -> EngineClient:
    return EngineClient(EngineClientConfig("local#0", socket_path=socket_path, poll_interval_s=60, **options))


async def collect(client: EngineClient, **body: Any) -> list[dict[str, Any]]:
    return [chunk async for chunk in client.stream("chat/completions", body, request_id="req-1")]


async def test_responses_and_chunks_come_back_as_the_engine_sent_them(engine: tuple[FakeEngine, str]) -> None:
    client = client_for(engine[1])
    try:
        response = await client.send("chat/completions", {}, request_id="req-1")
        assert response[MAX_TOKENS_CLAMPED_KEY] == [100, 50]  # the gateway turns it into the clamp header
        assert await collect(client) == [CHUNK, LAST]
        assert await collect(client) == [CHUNK, LAST]  # the connection went back to the pool and is reused
        assert await client.count_prompt_tokens({"messages": []}) == 17
    finally:
        await client.aclose()


async def test_engine_errors_come_back_as_the_same_gateway_errors(engine: tuple[FakeEngine, str]) -> None:
    client = client_for(engine[1])
    try:
        with pytest.raises(EngineLoadingError) as loading:
            await collect(client, mode="loading")
        assert (loading.value.status_code, loading.value.headers) == (503, {"retry-after": "5"})
        with pytest.raises(InvalidRequestError) as refused:
            await client.send("chat/completions", {"mode": "refused"}, request_id="req-1")
        assert (refused.value.status_code, refused.value.param) == (400, "temperature")
        with pytest.raises(EngineError) as failed:
            await collect(client, mode="error")
        assert (failed.value.status_code, failed.value.code) == (500, "engine_error")
        with pytest.raises(UnavailableError) as cut:
            await collect(client, mode="cut")
        assert cut.value.status_code == 503 and "middle of the stream" in cut.value.message
    finally:
        await client.aclose()


async def test_closing_a_stream_early_closes_its_connection(engine: tuple[FakeEngine, str]) -> None:
    fake, path = engine
    client = client_for(path)
    try:
        stream = client.stream("chat/completions", {"mode": "slow"}, request_id="req-1")
        assert await anext(stream) == CHUNK
        await stream.aclose()  # type: ignore[attr-defined]
        assert await asyncio.to_thread(fake.stream_closed.wait, 5.0)
    finally:
        await client.aclose()


async def test_state_stats_and_limits_are_the_engines_last_answer(engine: tuple[FakeEngine, str]) -> None:
    fake, path = engine
    client = client_for(path, default_max_tokens=0, clamp_max_tokens=False)
    try:
        await client.refresh()
        assert client.health_state() == "loading" and client.stats()["loaded"] is False
        assert client.output_limits() == OutputLimits(None, False, None)
        fake.state = {
            "pid": 4242,
            "state": "up",
            "context_length": 4096,
            "stats": {"name": "engine-side#0", "loaded": True, "num_running_seqs": 0, "max_model_len": 4096},
        }
        await client.refresh()
        assert client.health_state() == "up" and await client.check_health()
        stats = client.stats()
        assert (stats["name"], stats["pid"], stats["loaded"], stats["state"]) == ("local#0", 4242, True, "up")
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


TOO_LONG = InvalidRequestError("too long", code="context_length_exceeded")
UNAUTHORIZED = {"message": "x", "type": "authentication_error", "code": "invalid_api_key"}


@pytest.mark.parametrize(
    ("payload", "status", "kind", "code"),
    [
        (error_payload(LOADING), 200, EngineLoadingError, "engine_loading"),
        (error_payload(TOO_LONG), 200, InvalidRequestError, "context_length_exceeded"),
        ({"error": {"message": "x", "type": "api_error", "code": "engine_error"}}, 500, EngineError, "engine_error"),
        ({"error": UNAUTHORIZED}, 401, EngineError, "invalid_api_key"),  # the engine's key: not the caller's (502)
        ({"detail": "Not Found"}, 404, EngineError, "engine_error"),
    ],
)
def test_engine_error_from(payload: dict[str, Any], status: int, kind: type[GatewayError], code: str | None) -> None:
    error = engine_error_from(payload, status)
    assert type(error) is kind
    expected = payload.get("status", status) if "error" in payload and status != 401 else 502
    assert error.status_code == expected
    assert error.code == code


async def test_a_failed_load_in_the_engine_process_is_reported_with_its_code(tmp_path: Path) -> None:
    """The real engine server with a `model_path` that does not exist: its client reports the engine's own
    `load_failed` and code (readiness and the console show them), not a process that did not answer; once the
    process is gone, nothing of that stale answer is reported."""
    from gateway.engine_server import create_engine_app
    from gateway.health_probe import _load_error as load_failure
    from gateway.settings import Settings

    engine = {"model_path": str(tmp_path / "no-such-model"), "device": "cpu"}
    settings = Settings(_env_file=None, data_dir=tmp_path / "data", engine=engine)  # type: ignore[call-arg, arg-type]
    path = tmp_path / "engine.sock"
    client = client_for(str(path))
    try:
        with ThreadedServer(create_engine_app(settings), uds=str(path), log_config=None):
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
        await client.refresh()  # the process has stopped
        assert client.health_state() == "down" and client.stats()["load_failed"] is False
    finally:
        await client.aclose()
