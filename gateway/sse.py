"""Server-sent events: encoding for our responses and the streaming ASGI response that ends every stream
explicitly (error event on failure, cut-off or shutdown). Upstream streams are decoded by `backends.sse`."""

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

__all__ = [
    "DONE",
    "EventStreamResponse",
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
                scope.setdefault("state", {})["client_disconnected"] = True  # the request log's "client_left"
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
