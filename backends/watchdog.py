"""First-event and idle deadlines for an upstream stream, checked by one timer per stream.

An upstream can keep a connection busy without ever answering: SSE comments or pings forever, or silence after
a few tokens. aiohttp's socket read timeout restarts on every byte, so it never fires on comments; this fires on
the absence of *events* instead, and fails the pending read with `StreamStalled`.
"""

from __future__ import annotations

import asyncio

import aiohttp

__all__ = ["StreamStalled", "StreamWatchdog"]


class StreamStalled(Exception):
    """Set on the response's reader when no event arrived in time; `is_first`: none had arrived at all."""

    def __init__(self, *, is_first: bool) -> None:
        super().__init__("no event in time")
        self.is_first = is_first


class StreamWatchdog:
    """Fails the pending read of `reader` when no event arrives within `first_s` of `started_at` (loop time),
    then within `idle_s` of the previous one.

    The clock runs only while the stream waits for the upstream: the time the consumer holds an event (a slow
    client, backpressure) is not the upstream's fault and is not counted. The timer is re-armed only when it
    fires, because a deadline around every read (`asyncio.timeout`) costs about 10 µs per chunk.

        watchdog = StreamWatchdog(response.content, started_at=t0, first_s=600, idle_s=300)
        ... watchdog.is_paused = True; yield event; watchdog.resume() ...
        watchdog.cancel()  # in a finally
    """

    __slots__ = ("_handle", "_idle_s", "_limit_s", "_loop", "_progress_at", "_reader", "is_first", "is_paused")

    def __init__(self, reader: aiohttp.StreamReader, *, started_at: float, first_s: float, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._reader = reader
        self._idle_s = idle_s
        self._limit_s = first_s
        self._progress_at = started_at
        self.is_first = True
        self.is_paused = False  # the consumer holds an event: the upstream is not being waited for
        self._handle = self._loop.call_at(started_at + first_s, self._check)

    def resume(self) -> None:
        """The consumer is done with an event: the idle clock starts again from now."""
        self.is_paused = False
        self._progress_at = self._loop.time()
        if self.is_first:  # from now on the (usually shorter) idle limit: move the timer once
            self.is_first = False
            self._limit_s = self._idle_s
            self._handle.cancel()
            self._handle = self._loop.call_at(self._progress_at + self._idle_s, self._check)

    def cancel(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        deadline = self._progress_at + self._limit_s
        if self.is_paused:
            self._handle = self._loop.call_at(now + self._limit_s, self._check)
        elif now < deadline:
            self._handle = self._loop.call_at(deadline, self._check)
        else:
            self._reader.set_exception(StreamStalled(is_first=self.is_first))
