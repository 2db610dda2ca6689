"""Keep-alives for translated streams (SSE framing itself is `gateway.sse`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from gateway.translate.common import aclose_source

__all__ = ["with_keepalive"]

T = TypeVar("T")


async def with_keepalive(events: AsyncIterator[T], *, interval_s: float, keepalive: T) -> AsyncIterator[T]:
    """`events`, plus `keepalive` whenever nothing arrived for `interval_s` (a slow prefill, a queue), so that
    proxies and clients with idle timeouts keep the connection. The pending read is never cancelled by a
    keep-alive, only when the consumer stops early, and then `events` is closed too."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield keepalive
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        await aclose_source(events)
