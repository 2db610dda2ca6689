"""Server-sent events: encoding for our responses, incremental decoding of upstream streams, and the
streaming ASGI response that ends every stream explicitly (error event on failure, cut-off or shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.errors import GatewayError, UnavailableError
from gateway.normalize import malformed

__all__ = [
    "DONE",
    "EventStreamResponse",
    "SSEDataLines",
    "SSEDecoder",
    "encode_data",
    "encode_event",
    "encode_events",
    "openai_error_tail",
]

logger = logging.getLogger("unigate.sse")

DONE = b"data: [DONE]\n\n"
_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell nginx-style proxies not to buffer the stream
]


def encode_data(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def encode_event(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def encode_events(events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[bytes]:
    """`(event name, data)` pairs as SSE bytes with `event:` lines; closes `events` when the consumer stops."""
    try:
        async for name, data in events:
            yield encode_event(name, data)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def openai_error_tail(error: GatewayError) -> bytes:
    """How an OpenAI-family stream ends on failure: the error envelope as a data event, then [DONE]."""
    return encode_data(error.to_dict()) + DONE


class SSEDecoder:
    """Incremental SSE parser: feed raw bytes, get complete `(event, data)` pairs (per the HTML spec:
    `data:` lines joined by newlines, comments and `id`/`retry` ignored, CRLF or LF line ends).

    With `max_event_bytes`, an event whose data (plus the line still arriving) grows past it raises 502
    `upstream_malformed_response` instead of being buffered whole; an unfinished line is kept as pieces and
    joined once, when it ends, so a long line costs linear time."""

    __slots__ = ("_data", "_event", "_max_event_bytes", "_num_data", "_num_pending", "_pending")

    def __init__(self, *, max_event_bytes: int | None = None) -> None:
        self._pending: list[bytes] = []  # the unfinished last line, in pieces
        self._num_pending = 0
        self._data: list[bytes] = []
        self._num_data = 0
        self._event = ""
        self._max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[tuple[str, bytes]]:
        if b"\n" not in chunk:  # the unfinished line goes on
            if chunk:
                self._pending.append(chunk)
                self._num_pending += len(chunk)
                self._check_size(self._num_pending + self._num_data)
            return []
        if self._pending:
            self._pending.append(chunk)
            chunk = b"".join(self._pending)
            self._pending = []
            self._num_pending = 0
        lines = chunk.split(b"\n")
        tail = lines.pop()  # the unfinished last line (b"" when the chunk ended on a newline)
        events: list[tuple[str, bytes]] = []
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:
                if self._data:
                    events.append((self._event or "message", b"\n".join(self._data)))
                self._data = []
                self._num_data = 0
                self._event = ""
            elif line.startswith(b"data:"):
                value = line[5:]
                value = value[1:] if value.startswith(b" ") else value
                self._data.append(value)
                self._num_data += len(value)
                self._check_size(self._num_data)
            elif line.startswith(b"event:"):
                self._event = line[6:].strip().decode("utf-8", "replace")
        if tail:
            self._pending.append(tail)
            self._num_pending = len(tail)
            self._check_size(self._num_pending + self._num_data)
        return events

    def flush(self) -> list[tuple[str, bytes]]:
        """Events still pending when the stream ends without a final blank line."""
        events = self.feed(b"\n\n") if (self._pending or self._data) else []
        self._pending = []
        self._num_pending = 0
        return events

    def _check_size(self, num_bytes: int) -> None:
        if self._max_event_bytes is not None and num_bytes > self._max_event_bytes:
            raise malformed(
                f"a stream event is larger than the gateway's limit of {self._max_event_bytes} bytes "
                "(UNIGATE_MAX_SSE_EVENT_BYTES)"
            )


class SSEDataLines:
    """The payloads of an OpenAI-style stream read line by line (a client's view: `bench`, `doctor`): each
    `data:` line's text, stripped, up to `data: [DONE]`, which ends the iteration and sets `is_done`."""

    __slots__ = ("_lines", "is_done")

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self._lines = lines
        self.is_done = False

    async def __aiter__(self) -> AsyncIterator[str]:
        async for line in self._lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.is_done = True
                return
            yield data


class EventStreamResponse(Response):
    """Streams pre-encoded SSE bytes chunk by chunk (no buffering) and always ends the stream explicitly.

    - The events iterator raising a `GatewayError` (upstream broke, malformed chunk) → `error_tail(error)` is sent.
    - The client disconnecting → the iterator is cancelled and closed at once, so the upstream request stops.
    - The server cancelling the task at the shutdown deadline → `error_tail(server_shutting_down)` is sent and
      the response ends normally (the cancellation is taken back), so the server logs no traceback for it.
    `on_close` (e.g. `Call.aclose`) runs in every case, after the iterator is closed.
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        *,
        headers: dict[str, str] | None = None,
        error_tail: Callable[[GatewayError], bytes] = openai_error_tail,
        on_close: Callable[[], Awaitable[None]] | None = None,
        on_first_event: Callable[[], None] | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.extra_headers = headers or {}
        self.error_tail = error_tail
        self.on_close = on_close
        self.on_first_event = on_first_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = list(_HEADERS)
        raw_headers.extend((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers.items())
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        is_complete = False
        try:
            await asyncio.wait((pump, watcher), return_when=asyncio.FIRST_COMPLETED)
            is_complete = pump.done() and not pump.cancelled() and pump.exception() is None
        except asyncio.CancelledError:
            # The server's shutdown deadline passed: tell the client first (the server closes connections soon
            # after cancelling us), then stop the upstream and settle (which may wait on Redis).
            pump.cancel()
            watcher.cancel()
            error = UnavailableError(
                "The gateway is shutting down and its grace period ended before this stream finished. "
                "Retry the request; it will be served by another instance or after restart.",
                code="server_shutting_down",
            )
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "body": self.error_tail(error), "more_body": False})
            await _cancel(pump)
            if _take_back_cancel():
                return  # the response is complete; re-raising would only make uvicorn log a traceback for it
            raise
        finally:
            if not pump.done():  # the client went away first
                await _cancel(pump)
            watcher.cancel()
            try:
                if is_complete:  # end the response first: the client need not wait for `on_close` (settling)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await self._close()

    async def _pump(self, send: Send) -> None:
        is_first = True
        try:
            async for data in self.events:
                if is_first and self.on_first_event is not None:
                    self.on_first_event()
                is_first = False
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except GatewayError as error:
            await send({"type": "http.response.body", "body": self.error_tail(error), "more_body": True})
        except (asyncio.CancelledError, OSError):
            raise
        except Exception:
            logger.exception("stream failed")
            internal = GatewayError("The gateway failed while streaming this response; retry the request.")
            await send({"type": "http.response.body", "body": self.error_tail(internal), "more_body": True})

    async def _close(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
        if self.on_close is not None:
            await self.on_close()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return


def _take_back_cancel() -> bool:
    """Consume the one cancellation this task received (uvicorn's, at the shutdown deadline) so the request ends
    as the complete response it now is. False, consuming nothing, when more than one is pending: then something
    else wants the task gone too, and the CancelledError must propagate."""
    task = asyncio.current_task()
    if task is None or task.cancelling() != 1:
        return False
    task.uncancel()
    return True


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
