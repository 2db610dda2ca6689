"""HTTP/1.1 response framing, fed read by read: the head, then the body with its framing (chunked, Content-Length or
until the connection closes) removed, each piece of body kept with the time of the read that carried it.

Pure: no I/O and no asyncio, so `bench.http_stream` can run it inside `data_received` (it costs a few microseconds a
read) and so that it can be tested byte by byte. Malformed input raises `FramingError`.
"""

from __future__ import annotations

__all__ = ["ChunkedDecoder", "FramingError", "ResponseParser", "TimedRead", "parse_head"]

TimedRead = tuple[float, bytes]  # (time.perf_counter() when the bytes were read, the bytes)
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE_BYTES = 4096


class FramingError(ValueError):
    """The bytes are not a valid HTTP/1.1 response."""


class ChunkedDecoder:
    """Incremental `Transfer-Encoding: chunked` decoder: feed wire bytes, get body bytes; `is_done` after the last
    chunk and its trailer; bytes after that are `extra`."""

    __slots__ = ("_buffer", "_is_crlf_due", "_is_trailer", "_num_left", "extra", "is_done")

    def __init__(self) -> None:
        self._buffer = b""
        self._num_left = 0  # bytes of the current chunk's data still to come
        self._is_crlf_due = False  # the CRLF after a chunk's data
        self._is_trailer = False
        self.is_done = False
        self.extra = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.is_done:
            if self._num_left:
                take = min(self._num_left, end - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self._num_left -= take
                self._is_crlf_due = not self._num_left
                continue
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                if end - pos > MAX_CHUNK_LINE_BYTES:
                    raise FramingError("a chunk-size line is too long")
                break
            if self._is_crlf_due:
                if line_end != pos:
                    raise FramingError("chunk data longer than its declared size")
                self._is_crlf_due = False
                pos += 2
            elif self._is_trailer:
                self.is_done = line_end == pos
                pos = line_end + 2
            else:
                size = self._chunk_size(buffer[pos:line_end])
                start = line_end + 2
                stop = start + size
                if size and stop + 2 <= end and buffer[stop : stop + 2] == b"\r\n":  # the whole chunk is here
                    out.append(buffer[start:stop])
                    pos = stop + 2
                else:
                    self._num_left, self._is_trailer, pos = size, size == 0, start
        if self.is_done:
            self._buffer, self.extra = b"", buffer[pos:]
        else:
            self._buffer = buffer[pos:]
        return out[0] if len(out) == 1 else b"".join(out)

    @staticmethod
    def _chunk_size(line: bytes) -> int:
        try:
            size = int(line, 16)
        except ValueError:
            try:  # chunk extensions (`1a;name=value`) are allowed and ignored
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise FramingError(f"bad chunk-size line {line[:40]!r}") from None
        if size < 0:
            raise FramingError("negative chunk size")
        return size


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """Status code and headers (lower-case names; repeated ones joined with ", ") of a head without its blank line.
    An HTTP/1.0 response without `Connection: keep-alive` gets `connection: close`."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise FramingError(f"not an HTTP/1.x response: {lines[0][:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise FramingError(f"bad header line {line[:60]!r}")
        name = name.strip().lower()
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    if parts[0] == "HTTP/1.0" and "keep-alive" not in headers.get("connection", "").lower():
        headers["connection"] = "close"
    return int(parts[1]), headers


class ResponseParser:
    """One response, fed read by read. `feed` returns True when the reader should look now: the head is in, the
    body ended, or `max_pending` pieces of body are waiting (so a long stream is parsed in slices, not all at the
    end). Without that, body pieces just accumulate in `pieces`."""

    __slots__ = (
        "_chunked",
        "_head",
        "_num_left",
        "has_extra_bytes",
        "headers",
        "is_complete",
        "is_framed",
        "is_head_done",
        "max_pending",
        "num_bytes",
        "pieces",
        "status_code",
    )

    def __init__(self, *, is_head_request: bool = False, max_pending: int = 4) -> None:
        self.max_pending = max_pending
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.is_head_done = False
        self.is_complete = False
        self.is_framed = False  # the body's end was marked (not a closed connection): the connection may be reused
        self.has_extra_bytes = False  # bytes after the end: the connection is out of step
        self.pieces: list[TimedRead] = []
        self.num_bytes = 0
        self._head = b""
        self._chunked: ChunkedDecoder | None = None
        self._num_left = 0 if is_head_request else -1  # body bytes still due; -1: until the connection closes

    def feed(self, at: float, data: bytes) -> bool:
        self.num_bytes += len(data)
        if self.is_complete:
            self.has_extra_bytes = True
            return False
        if self.is_head_done:
            self._feed_body(at, data)
            return self.is_complete or len(self.pieces) >= self.max_pending
        self._head += data
        while (end := self._head.find(b"\r\n\r\n")) >= 0:
            status, headers = parse_head(self._head[:end])
            rest, self._head = self._head[end + 4 :], b""
            if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
                self._head = rest
                continue
            self._start_body(status, headers)
            if rest:
                self._feed_body(at, rest)
            return True
        if len(self._head) > MAX_HEAD_BYTES:
            raise FramingError("the response head is too long")
        return False

    def feed_eof(self) -> None:
        """The connection closed: the end of a body that runs until then, else a broken response."""
        if self.is_complete:
            return
        if not self.is_head_done:
            raise FramingError("the connection closed inside the response head")
        if self._chunked is not None or self._num_left >= 0:
            raise FramingError("the connection closed before the response ended")
        self.is_complete = True

    def _start_body(self, status: int, headers: dict[str, str]) -> None:
        self.status_code, self.headers, self.is_head_done = status, headers, True
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked = ChunkedDecoder()
        elif status in (204, 304) or self._num_left == 0:
            self._num_left = 0
        elif "content-length" in headers:
            try:
                self._num_left = int(headers["content-length"])
            except ValueError:
                raise FramingError(f"bad content-length {headers['content-length'][:40]!r}") from None
        if self._num_left == 0:
            self._end(extra=b"")

    def _feed_body(self, at: float, data: bytes) -> None:
        if self._chunked is not None:
            body = self._chunked.feed(data)
            if body:
                self.pieces.append((at, body))
            if self._chunked.is_done:
                self._end(self._chunked.extra)
        elif self._num_left >= 0:
            body = data[: self._num_left]
            self._num_left -= len(body)
            if body:
                self.pieces.append((at, body))
            if not self._num_left:
                self._end(data[len(body) :])
        else:
            self.pieces.append((at, data))

    def _end(self, extra: bytes) -> None:
        self.is_complete = self.is_framed = True
        self.has_extra_bytes = bool(extra)
