"""uvicorn's HTTP/1.1 protocols with limits on what a request may make them buffer: 431 instead of growing.

    uvicorn.Config(..., **protocol_options(settings))   # http= one of these classes, h11_max_incomplete_event_size

httptools (the default when installed) has no limit of its own on the request line, the headers, a chunked body's
trailer fields or a chunk-size line, and h11's (16 KiB by default) answers 400. Here a request whose line plus
headers exceed `max_header_bytes` (uvicorn carries it as `h11_max_incomplete_event_size`, so worker processes get
it with the config), or with more than `MAX_HEADERS` headers, is answered `431 headers_too_large` in the OpenAI
error envelope, and the connection is closed. So is a chunked body whose trailer fields exceed the same limits, or
whose trailer line or chunk-size line (extensions included) does not end within them; this holds after the app has
answered too (a 401 is sent as soon as the head is read, and the body is still read to keep the connection). A
request that is not HTTP/1.1 at all gets `400 invalid_request` in the same envelope. These answers are written
before any route is known, so they carry the console's security headers (harmless on JSON API answers).
"""

from __future__ import annotations

import asyncio
import importlib.util
from http import HTTPStatus
from typing import Any, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # uvicorn[standard] installs httptools

from gateway.errors import GatewayError, InvalidRequestError, render_openai
from gateway.security_headers import SECURITY_HEADERS

__all__ = ["MAX_HEADERS", "LimitedH11Protocol", "LimitedHttpToolsProtocol", "protocol_options"]

MAX_HEADERS = 100  # Apache's LimitRequestFields; SDKs send about 15, proxies add a few
_DEFAULT_MAX_HEAD_BYTES = 64 * 1024
_SLICE_BYTES = 16 * 1024  # httptools is fed at most this much at once, but for the rest of a body of known length
_LINGER_S = 2.0


def protocol_options(max_header_bytes: int) -> dict[str, Any]:
    """The uvicorn.Config options that apply the limits (httptools when installed, h11 otherwise)."""
    has_httptools = importlib.util.find_spec("httptools") is not None
    name = "LimitedHttpToolsProtocol" if has_httptools else "LimitedH11Protocol"
    return {"http": f"gateway.http_limits:{name}", "h11_max_incomplete_event_size": max_header_bytes}


def _head_too_large(max_head_bytes: int) -> GatewayError:
    return InvalidRequestError(
        f"The request headers are too large: at most {MAX_HEADERS} headers and {max_head_bytes} bytes for the "
        "request line and headers together (UNIGATE_MAX_HEADER_BYTES).",
        code="headers_too_large",
        status_code=431,
    )


def _framing_too_large(max_head_bytes: int) -> GatewayError:
    return InvalidRequestError(
        f"The chunked body's trailer fields or a chunk-size line are too large: at most {MAX_HEADERS} trailer "
        f"fields and {max_head_bytes} bytes (UNIGATE_MAX_HEADER_BYTES).",
        code="headers_too_large",
        status_code=431,
    )


def _not_http() -> GatewayError:
    return InvalidRequestError("The request is not valid HTTP/1.1.", code="invalid_request")


def _error_response(error: GatewayError) -> bytes:
    body = render_openai(error)
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "cache-control": "no-store",
        "connection": "close",
        **SECURITY_HEADERS,  # no route is known yet: this may be a /ui answer
    }
    status = HTTPStatus(error.status_code)
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Cycle(Protocol):
    """What the two protocols' request/response cycles share."""

    response_started: bool
    response_complete: bool
    disconnected: bool
    message_event: asyncio.Event


def _end_connection(
    transport: asyncio.Transport, cycle: _Cycle | None, error: GatewayError, *, is_answerable: bool = True
) -> None:
    """Answer `error` and end the connection; a request still being served is told its client has gone, so it
    neither reads more body nor writes after the answer. While a response is being written, the answer would land
    inside it: the connection is only closed. Closing with the client's bytes still unread would make the kernel
    send a reset, which can destroy the answer before the client reads it; so the answer is followed by a FIN and
    the connection kept (input discarded by the caller) for `_LINGER_S` or until the client closes."""
    if cycle is not None and not cycle.response_complete:
        is_answerable = is_answerable and not cycle.response_started
        cycle.disconnected = True
        cycle.message_event.set()
    if transport.is_closing():
        return
    if not is_answerable:
        transport.close()
        return
    transport.write(_error_response(error))
    if transport.can_write_eof():
        transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
    else:
        transport.close()


class _Connection(h11.Connection):
    """Remembers the status h11 suggests for its last protocol error (431: an incomplete event past the size bound)
    and whether the request's body was being read."""

    error_status = 400
    is_error_in_body = False

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        is_in_body = self.their_state is h11.SEND_BODY
        try:
            return super().next_event()
        except h11.RemoteProtocolError as error:
            self.error_status, self.is_error_in_body = error.error_status_hint, is_in_body
            raise


class LimitedH11Protocol(H11Protocol):
    """h11 already bounds whatever it buffers (`max_incomplete_event_size`: a head, a trailer section, a chunk-size
    line); this answers 431 in the envelope instead of a plain 400 (also after the app has answered, where uvicorn
    would fail), and also bounds the number of header lines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or _DEFAULT_MAX_HEAD_BYTES
        self.conn = self._conn = _Connection(h11.SERVER, self.max_head_bytes)
        self._is_rejected = False

    def data_received(self, data: bytes) -> None:
        if self._is_rejected:
            return  # lingering after the answer: discard
        if self.conn.their_state is h11.IDLE:  # still receiving a request head
            head = self.conn.trailing_data[0] + data
            end = head.find(b"\r\n\r\n")
            head = head if end < 0 else head[:end]
            if len(head) > self.max_head_bytes or head.count(b"\n") > MAX_HEADERS + 1:
                self._reject(_head_too_large(self.max_head_bytes))
                return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if self._conn.error_status != 431:
            self._reject(_not_http())
        elif self._conn.is_error_in_body:
            self._reject(_framing_too_large(self.max_head_bytes))
        else:
            self._reject(_head_too_large(self.max_head_bytes))

    def _reject(self, error: GatewayError) -> None:
        self._is_rejected = True
        _end_connection(self.transport, self.cycle, error)


class _TooLargeError(Exception):
    """Raised inside a parser callback to stop parsing; never leaves the protocol."""


def _content_length(headers: list[tuple[bytes, bytes]]) -> int:
    """The body's length when the head gives one plainly, else 0 (its bytes are then fed in slices)."""
    lengths = [value for name, value in headers if name == b"content-length"]
    if len(lengths) != 1 or not lengths[0].isdigit() or any(name == b"transfer-encoding" for name, _ in headers):
        return 0
    return int(lengths[0])


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """Counts the request line and each header (and then each trailer field) as httptools reports them: the exact
    limit. httptools reports a header or trailer line only at its end (buffering it until then), and a chunk-size
    line not at all, however long its extensions; so the raw bytes received since the parser last made progress (a
    head completed, body bytes, a message completed) are counted too, and at twice the limit the connection is cut
    without waiting for the line's end. To tell those bytes from the body's, httptools is fed `_SLICE_BYTES` at a
    time (a slice that made progress counts for nothing), but for the rest of a body of known length."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = self.config.h11_max_incomplete_event_size or _DEFAULT_MAX_HEAD_BYTES
        self._num_head_bytes = 0  # request line + headers, then the trailer fields, as parsed
        self._num_headers = 0
        self._num_unparsed = 0  # raw bytes received since the parser last made progress
        self._num_body_left = 0  # of a body with a Content-Length
        self._has_progressed = False
        self._is_in_head = True
        self._too_large: GatewayError | None = None  # why a callback stopped the parser
        self._is_rejected = False

    def data_received(self, data: bytes) -> None:
        start = 0
        while start < len(data) and not self._is_rejected:  # after the answer: discard
            end = start + max(_SLICE_BYTES, self._num_body_left)
            piece = data if start == 0 and end >= len(data) else data[start:end]
            self._has_progressed = False
            super().data_received(piece)
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # closed, or upgraded to a WebSocket: the rest is not HTTP/1.1 for this parser
            self._num_unparsed = 0 if self._has_progressed else self._num_unparsed + len(piece)
            if self._num_unparsed > 2 * self.max_head_bytes:
                self._reject(self._limit_error())
            start = end

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
        if self._is_in_head:  # uvicorn would add a trailer field to the request's headers (h11 drops them too)
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._is_in_head = False
        self._has_progressed = True
        self._num_head_bytes = self._num_headers = 0  # trailer fields, if any, are counted anew
        self._num_body_left = _content_length(self.headers)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._has_progressed = True
        self._num_body_left = max(0, self._num_body_left - len(body))
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._has_progressed = True
        self._num_body_left = 0
        super().on_message_complete()
        self._is_in_head = True

    def _limit_error(self) -> GatewayError:
        return (_head_too_large if self._is_in_head else _framing_too_large)(self.max_head_bytes)

    def _count(self, num_bytes: int) -> None:
        self._num_head_bytes += num_bytes
        if self._num_head_bytes > self.max_head_bytes or self._num_headers > MAX_HEADERS:
            self._too_large = self._limit_error()
            raise _TooLargeError  # httptools raises it as a parser error: send_400_response below

    def send_400_response(self, msg: str) -> None:
        self._reject(self._too_large or _not_http())

    def _reject(self, error: GatewayError) -> None:
        self._is_rejected = True
        # A pipelined request waits behind one whose response may be under way (not `self.cycle`, the newest).
        _end_connection(self.transport, self.cycle, error, is_answerable=not self.pipeline)
