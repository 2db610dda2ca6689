"""The engine host over a real Unix socket, spoken to frame by frame: calls multiplex on a connection, `abort` and a
closed connection cancel calls (their backend streams close), garbage closes only its own connection, the
backend's errors go back as `failed`, shutdown lets calls finish within its grace, and the socket is owner-only."""

from __future__ import annotations

import asyncio
import logging
import stat
import struct
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import Endpoint, HealthState, Json, MeteredStream, OutputLimits, Tenancy
from backends.engine_protocol import (
    Abort,
    AddRequest,
    CountTokens,
    Failed,
    Finished,
    GetState,
    Output,
    Response,
    State,
    TokenCount,
    WorkerMessage,
    encode,
    read_message,
)
from gateway.engine_host.host import EngineHost
from gateway.engine_host.main import bind_owner_only
from gateway.errors import InvalidRequestError

CHAT = "chat/completions"


class SlowBackend:
    """Streams `{"n": i}` every 10 ms for `body["num_chunks"]` chunks; records which streams were closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    async def send(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> Json:
        if body.get("refuse"):
            raise InvalidRequestError("no", param="temperature")
        if body.get("crash"):
            raise KeyError("a bug")
        await asyncio.sleep(body.get("sleep_s", 0))
        return {"id": request_id}

    async def stream(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> AsyncIterator[Json]:
        try:
            for index in range(body.get("num_chunks", 1000)):
                await asyncio.sleep(0.01)
                yield {"n": index}
        finally:
            self.closed.append(request_id)

    async def count_prompt_tokens(self, body: Json) -> int:
        return len(body["messages"])

    def health_state(self) -> HealthState:
        return "up"

    def output_limits(self) -> OutputLimits:
        return OutputLimits(2048, True, None)

    def stats(self) -> dict[str, Any]:
        return {"loaded": True}


class Worker:
    """One raw connection to the host."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: Path) -> Worker:
        return cls(*await asyncio.open_unix_connection(str(path)))

    def send(self, message: WorkerMessage) -> None:
        self.writer.write(encode(message))

    async def next(self) -> Any:
        return await asyncio.wait_for(read_message(self.reader), 5)

    async def until(self, kind: type, call_id: int) -> Any:
        while not (isinstance(message := await self.next(), kind) and message.call_id == call_id):
            assert message is not None, "the host closed the connection"
        return message


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[EngineHost, SlowBackend, Path]]:
    backend = SlowBackend()
    host = EngineHost(backend)
    path = tmp_path / "engine.sock"
    await host.start(bind_owner_only(path))
    yield host, backend, path
    await host.shutdown(0)


async def wait_until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_the_socket_is_owner_only(tmp_path: Path) -> None:
    (tmp_path / "engine.sock").write_text("stale")
    sock = bind_owner_only(tmp_path / "engine.sock")
    try:
        assert stat.S_IMODE((tmp_path / "engine.sock").stat().st_mode) == 0o600
        assert stat.S_ISSOCK((tmp_path / "engine.sock").stat().st_mode)
    finally:
        sock.close()


async def test_calls_share_a_connection_and_an_abort_ends_only_its_own(served: Any) -> None:
    host, backend, path = served
    worker = await Worker.connect(path)
    worker.send(AddRequest(1, "r1", CHAT, True, {}))
    worker.send(AddRequest(2, "r2", CHAT, True, {"num_chunks": 3}))
    worker.send(CountTokens(3, {"messages": [{}, {}]}))
    worker.send(GetState(4))
    seen: dict[int, list[Any]] = {1: [], 2: [], 3: [], 4: []}
    while not (seen[2] and isinstance(seen[2][-1], Finished)):
        message = await worker.next()
        seen[message.call_id].append(message)
    assert seen[2] == [Output(2, {"n": 0}), Output(2, {"n": 1}), Output(2, {"n": 2}), Finished(2)]
    assert seen[3] == [TokenCount(3, 2)]
    [state] = seen[4]
    assert isinstance(state, State) and (state.state, state.context_length, state.stats) == (
        "up",
        2048,
        {"loaded": True},
    )
    assert seen[1] and all(isinstance(m, Output) for m in seen[1])
    worker.send(Abort(1))
    await wait_until(lambda: "r1" in backend.closed and host.num_calls() == 0)
    worker.send(AddRequest(5, "r5", CHAT, False, {}))
    assert await worker.until(Response, 5) == Response(5, {"id": "r5"})  # (outputs of call 1 may come before)
    worker.writer.close()


async def test_a_closed_connection_aborts_its_calls_in_one_quiet_line(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host, backend, path = served
    worker = await Worker.connect(path)
    worker.send(AddRequest(1, "r1", CHAT, True, {}))
    worker.send(AddRequest(2, "r2", CHAT, True, {}))
    await worker.until(Output, 2)
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        worker.writer.close()
        await wait_until(lambda: sorted(backend.closed) == ["r1", "r2"] and host.num_calls() == 0)
    [line] = caplog.records
    assert line.levelno == logging.INFO and "aborting its 2 calls" in line.getMessage()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x05hello",
        struct.pack(">I", 2**31),
        encode(Finished(1)),
        encode(AddRequest(1, "again", CHAT, True, {})),
    ],
    ids=["not-json", "oversize", "a-host-message", "a-running-call-id"],
)
async def test_garbage_closes_only_its_own_connection(
    served: Any, caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    _, backend, path = served
    good, bad = await Worker.connect(path), await Worker.connect(path)
    good.send(AddRequest(1, "good", CHAT, True, {"num_chunks": 30}))
    bad.send(AddRequest(1, "bad", CHAT, True, {}))
    await bad.until(Output, 1)
    with caplog.at_level(logging.WARNING, logger="unigate.engine"):
        bad.writer.write(garbage)
        while (message := await bad.next()) is not None:  # the host closes it (outputs already sent first)
            assert isinstance(message, Output)
    assert "bad" in backend.closed
    assert await good.until(Finished, 1) == Finished(1)  # the other connection streamed to its end
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    good.writer.close()


async def test_errors_go_back_as_failed_and_a_bug_is_logged(served: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, _, path = served
    worker = await Worker.connect(path)
    worker.send(AddRequest(1, "r1", "embeddings", False, {}))
    worker.send(AddRequest(2, "r2", CHAT, False, {"refuse": True}))
    worker.send(AddRequest(3, "r3", CHAT, False, {"crash": True}))
    replies = {m.call_id: m for m in [await worker.next() for _ in range(3)]}
    assert all(isinstance(reply, Failed) for reply in replies.values())
    assert (replies[1].status, replies[1].code) == (404, "not_found")
    assert (replies[2].error, replies[2].status, replies[2].param) == ("InvalidRequestError", 400, "temperature")
    assert (replies[3].error, replies[3].status, replies[3].code) == ("EngineError", 500, "engine_error")
    [bug] = [r for r in caplog.records if r.exc_info]
    assert bug.levelno == logging.ERROR
    worker.writer.close()


async def test_shutdown_lets_calls_finish_within_its_grace_and_refuses_new_ones(tmp_path: Path) -> None:
    host = EngineHost(SlowBackend())
    path = tmp_path / "engine.sock"
    await host.start(bind_owner_only(path))
    worker = await Worker.connect(path)
    worker.send(AddRequest(1, "quick", CHAT, False, {"sleep_s": 0.2}))
    worker.send(AddRequest(2, "endless", CHAT, True, {}))
    await worker.until(Output, 2)
    stopping = asyncio.create_task(host.shutdown(1.0))
    await asyncio.sleep(0.05)
    worker.send(AddRequest(3, "late", CHAT, False, {}))
    replies = [await worker.until(Failed, 3), await worker.until(Response, 1)]
    assert (replies[0].status, replies[0].code) == (503, "server_shutting_down")
    await asyncio.wait_for(stopping, 5)  # the endless stream was cancelled at the end of the grace
    assert host.num_calls() == 0
    with pytest.raises(OSError):
        await Worker.connect(path)


class MeteredBackend(SlowBackend):
    """Streams three chunks, counting as an engine would: the prompt's 40 tokens (8 cached), one token a chunk;
    records the tenancy each call came with."""

    def __init__(self) -> None:
        super().__init__()
        self.tenancies: list[Any] = []

    def stream(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> MeteredStream:
        self.tenancies.append(tenancy)
        counts = {"n": 0}

        async def chunks() -> AsyncGenerator[Json, None]:
            for index in range(3):
                counts["n"] = index + 1
                yield {"n": index}

        def meter() -> Json:
            usage = {"prompt_tokens": 40, "completion_tokens": counts["n"], "total_tokens": 40 + counts["n"]}
            return {**usage, "prompt_tokens_details": {"cached_tokens": 8}}

        return MeteredStream(chunks(), meter)


async def test_an_add_runs_under_its_tenancy_and_each_output_carries_the_counts_so_far(tmp_path: Path) -> None:
    backend = MeteredBackend()
    host = EngineHost(backend)
    await host.start(bind_owner_only(tmp_path / "engine.sock"))
    try:
        worker = await Worker.connect(tmp_path / "engine.sock")
        worker.send(AddRequest.of(1, "r1", CHAT, True, {}, Tenancy("team-a", 2.0, "high")))
        outputs = [await worker.next() for _ in range(3)]
        assert await worker.next() == Finished(1)
    finally:
        await host.shutdown(0)
    assert [o.counts for o in outputs] == [[40, 8, 1], [40, 8, 2], [40, 8, 3]]
    assert backend.tenancies == [Tenancy("team-a", 2.0, "high")]
