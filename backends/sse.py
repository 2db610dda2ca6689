"""Incremental decoding of an upstream's server-sent events (the HTML spec's `text/event-stream`).

Pure (no I/O, no web app): the upstream backends feed it the bytes they read, and `bench` reads a gateway's
streams with it.
"""

from __future__ import annotations

from gateway.errors import upstream_malformed

__all__ = ["SSEDecoder"]


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
            raise upstream_malformed(
                f"a stream event is larger than the gateway's limit of {self._max_event_bytes} bytes "
                "(UNIGATE_MAX_SSE_EVENT_BYTES)"
            )
