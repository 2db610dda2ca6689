"""uvicorn's HTTP/1.1 protocols with limits on the request head: 431 instead of buffering whatever a client sends.

    uvicorn.Config(..., **protocol_options(settings))   # http= one of these classes, h11_max_incomplete_event_size

httptools (the default when installed) has no limit of its own on the request line or headers, and h11's (16 KiB by
default) answers 400. Here a request whose line plus headers exceed `max_header_bytes` (uvicorn carries it as
`h11_max_incomplete_event_size`, so worker processes get it with the config), or with more than `MAX_HEADERS`
headers, is answered `431 headers_too_large` in the OpenAI error envelope, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # uvicorn[standard] installs httptools

from gateway.errors import InvalidRequestError, render_openai

__all__ = ["MAX_HEADERS", "LimitedH11Protocol", "LimitedHttpToolsProtocol", "protocol_options"]

MAX_HEADERS = 100  # Apache's LimitRequestFields; SDKs send about 15, proxies add a few
_DEFAULT_MAX_HEAD_BYTES = 64 * 1024


def protocol_options(max_header_bytes: int) -> dict[str, Any]:
    """The uvicorn.Config options that apply the limits (httptools when installed, h11 otherwise)."""
    has_httptools = importlib.util.find_spec("httptools") is not None
    name = "LimitedHttpToolsProtocol" if has_httptools else "LimitedH11Protocol"
    return {"http": f"gateway.http_limits:{name}", "h11_max_incomplete_event_size": max_header_bytes}


def _too_large_response(max_head_bytes: int) -> bytes:
    error = InvalidRequestError(
        f"The request headers are too large: at most {MAX_HEADERS} headers and {max_head_bytes} bytes for the "
        "request line and headers together (UNIGATE_MAX_HEADER_BYTES).",
        code="headers_too_large",
        status_code=431,
    )
    body = render_openai(error)
    head = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n"
    )
    return head + body


class _HeadTooLargeError(Exception):
    """Raised inside a parser callback to stop parsing; never leaves the protocol."""


_LINGER_S = 2.0


def _reject(transport: asyncio.Transport, max_head_bytes: int) -> None:
    """Answer 431 and end the connection. Closing with the client's bytes still unread would make the kernel send
    a reset, which can destroy the answer before the client reads it; so the answer is followed by a FIN and the
    connection kept (input discarded by the caller) for `_LINGER_S` or until the client closes."""
    if transport.is_closing():
        return
    transport.write(_too_large_response(max_head_bytes))
    if transport.can_write_eof():
        transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
    else:
        transport.close()


class LimitedH11Protocol(H11Protocol):
    """h11 already bounds the head's size (`max_incomplete_event_size`); this answers 431 instead of 400 and also
    bounds the number of header lines."""

    _is_rejected = False

    def data_received(self, data: bytes) -> None:
        if self._is_rejected:
            return  # lingering after a 431: discard
        if self.conn.their_state is h11.IDLE:  # still receiving a request head
            buffered = self.conn.trailing_data[0]
            max_head_bytes = self.config.h11_max_incomplete_event_size or _DEFAULT_MAX_HEAD_BYTES
            head = buffered + data
            end = head.find(b"\r\n\r\n")
            head = head if end < 0 else head[:end]
            if len(head) > max_head_bytes or head.count(b"\n") > MAX_HEADERS + 1:
                self._is_rejected = True
                _reject(self.transport, max_head_bytes)
                return
        super().data_received(data)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """Counts the request line and each header as httptools reports them (the exact limit), and the raw bytes
    received while a head is incomplete (httptools buffers a header until its end: at twice the limit the
    connection is cut without waiting for it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or _DEFAULT_MAX_HEAD_BYTES
        self._num_head_bytes = 0  # request line + headers, as parsed
        self._num_received_in_head = 0  # raw bytes received while a head is incomplete
        self._num_headers = 0
        self._is_in_head = True
        self._has_head_ended = False  # a head was completed by the bytes being parsed
        self._is_rejected = False

    def data_received(self, data: bytes) -> None:
        if self._is_rejected:
            return  # lingering after a 431: discard
        was_in_head, self._has_head_ended = self._is_in_head, False
        super().data_received(data)
        # Raw bytes count only while one head stays incomplete from before the chunk to after it: a chunk that
        # ended a head or a body carried body bytes (a body's last segment can be any size), and whatever part of
        # it began the next head is counted exactly by on_url/on_header.
        if was_in_head and self._is_in_head and not self._has_head_ended and not self._is_rejected:
            self._num_received_in_head += len(data)
            if self._num_received_in_head > 2 * self.max_head_bytes:
                self._is_rejected = True
                _reject(self.transport, self.max_head_bytes)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._num_head_bytes = self._num_headers = 0
        self._is_in_head = True

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        self._count(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._is_in_head = False
        self._has_head_ended = True
        self._num_received_in_head = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._is_in_head = True

    def _count(self, num_bytes: int) -> None:
        self._num_head_bytes += num_bytes
        if self._num_head_bytes > self.max_head_bytes or self._num_headers > MAX_HEADERS:
            self._is_rejected = True
            raise _HeadTooLargeError  # httptools raises it as a parser error: send_400_response below

    def send_400_response(self, msg: str) -> None:
        if self._is_rejected:
            _reject(self.transport, self.max_head_bytes)
        else:
            super().send_400_response(msg)
