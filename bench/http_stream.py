"""The measuring transport: HTTP/1.1 over asyncio protocols, with every read timestamped where it arrives.

Why not httpx or aiohttp for the timed requests: both hand bytes to the caller only after the reading task wakes
up, so when several streams become readable at once, the last one's timestamp waits for the others' parsing and
bookkeeping. Here the event loop's `data_received` callback, called straight from its socket read, first takes
`time.perf_counter()`, then strips the HTTP framing (`bench.http_framing`, a few microseconds) and stores
`(timestamp, body bytes)`. The request's task is woken only when the head is in, when the body has ended, or when
`max_pending` pieces wait; SSE decoding and JSON parsing run there, in slices, and cannot shift any timestamp.

Exceptions, one tree rooted at `HttpStreamError`:
    HttpStreamError
    ├── ConnectError       cannot open the connection (refused, unreachable, DNS, TLS handshake)
    ├── StreamTimeoutError no byte for `timeout_s` (or no connection within `connect_timeout_s`)
    └── StreamBrokenError  the connection closed mid-response, or the response is not valid HTTP/1.1

Scope: plain HTTP/1.1 and TLS, keep-alive with a bounded pool for one origin, `Content-Length`, chunked and
close-delimited bodies, no compression (`Accept-Encoding: identity`), no proxies, no redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

from bench.http_framing import FramingError, ResponseParser, TimedRead

__all__ = [
    "ConnectError",
    "HttpStreamError",
    "StreamBrokenError",
    "StreamPool",
    "StreamResponse",
    "StreamTimeoutError",
    "TimedRead",
]


class HttpStreamError(Exception):
    """The request did not get a complete HTTP response."""


class ConnectError(HttpStreamError):
    pass


class StreamTimeoutError(HttpStreamError):
    pass


class StreamBrokenError(HttpStreamError):
    pass


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; `parser` is the response in progress, if any."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: ResponseParser | None = None
        self.last_read_at = 0.0
        self.is_closed = False
        self.is_out_of_step = False  # bytes arrived that belong to no request
        self.error: HttpStreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # first: this is the timestamp the figures are made of
        self.last_read_at = now
        parser = self.parser
        if parser is None:
            self.is_out_of_step = True
            return
        try:
            is_due = parser.feed(now, data)
        except FramingError as exc:
            self.fail(StreamBrokenError(str(exc)))
            return
        if is_due:
            self._wake()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.transport = None
        if self.parser is not None and self.error is None:
            try:
                self.parser.feed_eof()
            except FramingError as error:
                self.error = StreamBrokenError(str(error))
        self._wake()

    def fail(self, error: HttpStreamError) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until `data_received` says the reader is due, or the connection closes or fails."""
        if self.error is not None or self.is_closed:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class StreamResponse:
    """A response whose head has been read; `body_reads()` hands out the body as it arrived."""

    __slots__ = ("_connection", "_parser", "headers", "sent_at", "status_code")

    def __init__(self, connection: _Connection, parser: ResponseParser, sent_at: float) -> None:
        self.status_code = parser.status_code
        self.headers = parser.headers  # lower-case names; repeated headers joined with ", "
        self.sent_at = sent_at  # time.perf_counter() just before the request's bytes were written
        self._connection = connection
        self._parser = parser

    @property
    def is_complete(self) -> bool:
        return self._parser.is_complete

    @property
    def is_reusable(self) -> bool:
        """Complete, framed, nothing after it, and the server did not ask to close: the next request may use it."""
        parser, connection = self._parser, self._connection
        return (
            parser.is_complete
            and parser.is_framed
            and not parser.has_extra_bytes
            and not connection.is_closed
            and not connection.is_out_of_step
            and connection.error is None
            and self.headers.get("connection", "").lower() != "close"
        )

    async def body_reads(self) -> list[TimedRead]:
        """The body bytes that have arrived since the last call (framing removed), each with the time its read
        arrived; waits until there are some; [] once the body has ended."""
        parser, connection = self._parser, self._connection
        while True:
            if parser.pieces:
                pieces, parser.pieces = parser.pieces, []
                return pieces
            if connection.error is not None:
                raise connection.error
            if parser.is_complete:
                return []
            if connection.is_closed:
                raise StreamBrokenError("the connection closed before the response ended")
            await connection.wait()

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while reads := await self.body_reads():
            parts.extend(body for _, body in reads)
        return b"".join(parts)


class StreamPool:
    """Up to `max_connections` keep-alive connections to the origin of `base_url`."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        headers: dict[str, str] | None = None,
        # Wake the reading task every 4 reads: parsing a whole stream at its end made a burst that delayed other
        # streams' last reads when many ended together (TPOT p50 +0.6-1.1% at c=256, against +0.1-0.3% with 4).
        max_pending_reads: int = 4,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path_prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.max_pending_reads = max_pending_reads
        self._ssl = (ssl_context or _default_ssl_context()) if parts.scheme == "https" else None
        host_header = parts.netloc.rsplit("@", 1)[-1]
        fixed = {"host": host_header, "user-agent": "unigate-bench", "accept": "*/*", "accept-encoding": "identity"}
        fixed |= {name.lower(): value for name, value in (headers or {}).items()}
        self._head_lines = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def aclose(self) -> None:
        for connection in self._idle:
            if connection.transport is not None:
                connection.transport.close()
        self._idle = []

    def encode(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> bytes:
        """The request's bytes, built before the clock starts."""
        head = f"{method} {self.path_prefix}{path} HTTP/1.1\r\n{self._head_lines}"
        if body or method in ("POST", "PUT", "PATCH"):
            head += f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        return head.encode("latin-1") + b"\r\n" + body

    @contextlib.asynccontextmanager
    async def request(self, data: bytes) -> AsyncIterator[StreamResponse]:
        """Send the encoded request; yields once the response head is in. A reused connection that turns out
        to have been closed by the server (an idle keep-alive timeout) is replaced once, transparently."""
        async with self._slots:
            connection, is_reused = await self._connection()
            timer = _IdleTimer(connection, self.timeout_s)
            response = None
            try:
                response = await self._exchange(connection, data, timer)
                if response is None and is_reused:
                    timer.cancel()
                    connection, _ = await self._connection(is_new=True)
                    timer = _IdleTimer(connection, self.timeout_s)
                    response = await self._exchange(connection, data, timer)
                if response is None:
                    raise StreamBrokenError("the server closed the connection without a response")
                yield response
            finally:
                timer.cancel()
                connection.parser = None
                if response is not None and response.is_reusable:
                    self._idle.append(connection)
                elif connection.transport is not None:
                    connection.transport.close()

    async def _connection(self, *, is_new: bool = False) -> tuple[_Connection, bool]:
        while self._idle and not is_new:
            connection = self._idle.pop()
            if not connection.is_closed and not connection.is_out_of_step:
                return connection, True
            if connection.transport is not None:
                connection.transport.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    _Connection, self.host, self.port, ssl=self._ssl, server_hostname=self.host if self._ssl else None
                )
        except TimeoutError:
            raise StreamTimeoutError(
                f"no connection to {self.host}:{self.port} within {self.connect_timeout_s:g} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return connection, False

    async def _exchange(self, connection: _Connection, data: bytes, timer: _IdleTimer) -> StreamResponse | None:
        """Write the request and wait for the response head; None if the connection closed before a single byte
        came back (on a reused connection: the server had closed it while idle)."""
        assert connection.transport is not None and connection.parser is None
        parser = ResponseParser(max_pending=self.max_pending_reads, is_head_request=data.startswith(b"HEAD "))
        connection.parser = parser
        sent_at = time.perf_counter()
        connection.last_read_at = sent_at
        connection.transport.write(data)
        timer.start()
        while not parser.is_head_done:
            if connection.error is not None:
                if parser.num_bytes == 0 and connection.is_closed:
                    connection.parser = None
                    return None
                raise connection.error
            if connection.is_closed:
                connection.parser = None
                return None
            await connection.wait()
        return StreamResponse(connection, parser, sent_at)


def _default_ssl_context() -> ssl.SSLContext:
    """Verified TLS with certifi's CA bundle when it is installed (as httpx does), else the system's."""
    try:
        import certifi
    except ImportError:
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class _IdleTimer:
    """Fails the connection when no byte has arrived for `timeout_s`. One timer per request, re-armed lazily
    (from `last_read_at`) instead of on every read, so reads stay cheap."""

    def __init__(self, connection: _Connection, timeout_s: float) -> None:
        self.connection = connection
        self.timeout_s = timeout_s
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def _check(self) -> None:
        idle_s = time.perf_counter() - self.connection.last_read_at
        if idle_s >= self.timeout_s:
            self.connection.fail(StreamTimeoutError(f"no data for {self.timeout_s:g} s"))
        else:
            self._handle = asyncio.get_running_loop().call_later(self.timeout_s - idle_s, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
