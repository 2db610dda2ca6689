"""A raw-asyncio OpenAI-style streaming server whose chunks leave on a fixed schedule, and which records when they did.

The reference for the bench client's fidelity: each chat completion sends a role-only chunk at once (it must not
count as the first token), the first content chunk `ttft_s` after the request arrived, then one content chunk
every `itl_s`, scheduled on absolute times (`loop.call_at`) so timer overshoot never accumulates, then the finish
chunk, the usage chunk (when asked for) and `[DONE]`. HTTP/1.1 keep-alive, chunked transfer encoding.

For every request it records, on `time.perf_counter()` (CLOCK_MONOTONIC on Linux, so comparable across processes),
when the request arrived (`Schedule.arrival`) and when each content chunk was handed to the socket: the *delivered*
timings, which a client's measurements are compared with. `GET /timings` returns them (`?reset=1` clears them).

In a thread: `with TimedSSEServer(ttft_s=0.1, itl_s=0.01) as server: ... server.take_delivered()`.
In its own process (benchmarks/bench_fidelity.py): `python tests/bench/timed_sse_server.py --port 8123 --ttft 0.2`.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

__all__ = ["Delivered", "Schedule", "TimedSSEServer", "delivered_from", "serve"]

_MAX_HEAD_BYTES = 64 * 1024
_MODEL = "fake-model"


@dataclass(slots=True)
class Delivered:
    """What the server did for one request, on its own clock."""

    read_at: float  # the request had arrived (the start of the server's batch of reads that took it in)
    content_at: list[float] = field(default_factory=list)  # each content chunk handed to the socket

    @property
    def ttft_s(self) -> float | None:
        return self.content_at[0] - self.read_at if self.content_at else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.content_at) < 2:
            return None
        return (self.content_at[-1] - self.content_at[0]) / (len(self.content_at) - 1)

    def to_list(self) -> list[float]:
        return [self.read_at, *self.content_at]


def delivered_from(rows: list[list[float]]) -> list[Delivered]:
    """Inverse of `Delivered.to_list`, for timings fetched from `/timings`."""
    return [Delivered(row[0], row[1:]) for row in rows]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {"id": "chatcmpl-timed", "object": "chat.completion.chunk", "created": 0}
    payload["model"] = _MODEL
    payload["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        payload["usage"] = usage
    return _sse(payload)


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


_ROLE = _http_chunk(_chunk({"role": "assistant", "content": ""}))
_FINISH = _http_chunk(_chunk({}, finish="length"))
_DONE = _http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


class Schedule:
    """Shared by every connection of one server: the injected timings, and what was delivered."""

    def __init__(self, ttft_s: float, itl_s: float, default_tokens: int = 16) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.default_tokens = default_tokens
        self.delivered: list[Delivered] = []
        self._tokens: list[bytes] = []
        self._batch_at: float | None = None

    def arrival(self) -> float:
        """When the bytes being handled reached the server: the start of the event loop's current batch of
        reads. Every request read in one batch was there by then, including those that wait while the server
        handles the ones before them: that queue is part of what the server delivers, not the client's doing."""
        if self._batch_at is None:
            self._batch_at = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._end_batch)  # runs after this batch's read callbacks
        return self._batch_at

    def _end_batch(self) -> None:
        self._batch_at = None

    def token(self, index: int) -> bytes:
        while len(self._tokens) <= index:
            self._tokens.append(_http_chunk(_chunk({"content": f" t{len(self._tokens)}"})))
        return self._tokens[index]


class _Connection(asyncio.Protocol):
    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.is_busy = False  # a response is streaming; pipelined requests wait in the buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        arrived_at = self.schedule.arrival()
        self.buffer += data
        if not self.is_busy:
            self._next_request(arrived_at)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def _next_request(self, arrived_at: float) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD_BYTES:
                self._reply(431, b"{}", close=True)
            return
        lines = self.buffer[:end].decode("latin-1").split("\r\n")
        method, target = [*lines[0].split(" "), "", ""][:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < end + 4 + length:
            return
        body = self.buffer[end + 4 : end + 4 + length]
        self.buffer = self.buffer[end + 4 + length :]
        self._handle(method, target, body, headers.get("connection", "").lower() == "close", arrived_at)

    def _handle(self, method: str, target: str, body: bytes, close: bool, arrived_at: float) -> None:
        path, _, query = target.partition("?")
        if method == "POST" and path.endswith("/chat/completions"):
            self._stream(orjson.loads(body or b"{}"), arrived_at, close)
        elif method == "GET" and path.endswith("/models"):
            self._reply(200, orjson.dumps({"object": "list", "data": [{"id": _MODEL, "object": "model"}]}), close)
        elif method == "GET" and path == "/timings":
            rows = [d.to_list() for d in self.schedule.delivered]
            if "reset=1" in query:
                self.schedule.delivered = []
            self._reply(200, orjson.dumps(rows), close)
        else:
            self._reply(404, b'{"error": {"message": "not found", "code": "not_found"}}', close)

    def _reply(self, status: int, body: bytes, close: bool = False) -> None:
        if self.transport is None:
            return
        head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        self.transport.write(head.encode() + (b"connection: close\r\n\r\n" if close else b"\r\n") + body)
        if close:
            self.transport.close()
        elif self.buffer:
            self._next_request(time.perf_counter())  # a pipelined request: it waited for the one before

    def _stream(self, body: dict[str, Any], read_at: float, close: bool) -> None:
        assert self.transport is not None
        schedule = self.schedule
        num_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or schedule.default_tokens)
        is_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        record = Delivered(read_at)
        schedule.delivered.append(record)
        self.is_busy = True
        self.transport.write(_STREAM_HEAD + _ROLE)
        loop = asyncio.get_running_loop()
        # Absolute times from the request's arrival, so a timer that fires late does not push back the ones after it.
        first_at = loop.time() + schedule.ttft_s - (time.perf_counter() - read_at)
        loop.call_at(first_at, self._send_token, record, first_at, 0, num_tokens, is_usage, close)

    def _send_token(
        self, record: Delivered, first_at: float, index: int, num_tokens: int, is_usage: bool, close: bool
    ) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        record.content_at.append(time.perf_counter())
        data = self.schedule.token(index)
        is_last = index == num_tokens - 1
        if is_last:
            usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
            tail = _http_chunk(_chunk(None, usage=usage)) if is_usage else b""
            data += _FINISH + tail + _DONE
        self.transport.write(data)
        if not is_last:
            next_at = first_at + (index + 1) * self.schedule.itl_s
            args = (record, first_at, index + 1, num_tokens, is_usage, close)
            asyncio.get_running_loop().call_at(next_at, self._send_token, *args)
            return
        self.is_busy = False
        if close:
            self.transport.close()
        elif self.buffer:
            self._next_request(time.perf_counter())  # a pipelined request: it waited for the one before


async def serve(host: str, port: int, schedule: Schedule) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(schedule), host, port, backlog=4096)


class TimedSSEServer:
    """The server on a free loopback port, on its own event loop in a background thread."""

    def __init__(self, ttft_s: float, itl_s: float, *, default_tokens: int = 16) -> None:
        self.schedule = Schedule(ttft_s, itl_s, default_tokens)
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    def __enter__(self) -> TimedSSEServer:
        self._thread.start()
        start = serve("127.0.0.1", 0, self.schedule)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def take_delivered(self) -> list[Delivered]:
        """What was delivered since the last call (swapped out on the server's own loop)."""

        async def take() -> list[Delivered]:
            rows, self.schedule.delivered = self.schedule.delivered, []
            return rows

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description="A streaming chat-completions server with scheduled chunks.")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ttft", type=float, default=0.2, help="seconds from the request to the first token")
    parser.add_argument("--itl", type=float, default=0.02, help="seconds between tokens")
    parser.add_argument("--tokens", type=int, default=16, help="tokens when the request gives no max_tokens")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()

    async def run() -> None:
        server = await serve("127.0.0.1", args.port, Schedule(args.ttft, args.itl, args.tokens))
        async with server:
            await server.serve_forever()

    if args.uvloop:
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


if __name__ == "__main__":
    main()
