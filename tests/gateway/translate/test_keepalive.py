"""with_keepalive: keep-alives while the source is quiet, items in order, the source closed when we stop early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from translate_helpers import SourceClosed

from gateway.translate import with_keepalive

PING = "ping"


async def _gated(gate: asyncio.Event, closed: SourceClosed) -> AsyncIterator[str]:
    try:
        yield "first"
        await gate.wait()  # a long prefill: nothing arrives until the test has seen a keep-alive
        yield "second"
    finally:
        closed.is_closed = True


async def test_keepalives_fill_quiet_periods_without_losing_items() -> None:
    gate, closed = asyncio.Event(), SourceClosed()
    received: list[str] = []
    async for item in with_keepalive(_gated(gate, closed), interval_s=0.01, keepalive=PING):
        received.append(item)
        if item == PING:
            gate.set()
    assert received[0] == "first" and received[-1] == "second"
    assert PING in received and set(received[1:-1]) == {PING}
    assert closed.is_closed


async def test_stopping_early_cancels_the_pending_read_and_closes_the_source() -> None:
    gate, closed = asyncio.Event(), SourceClosed()
    stream = with_keepalive(_gated(gate, closed), interval_s=0.01, keepalive=PING)
    assert await anext(stream) == "first"
    assert await anext(stream) == PING  # the source is now blocked inside `gate.wait()`
    await stream.aclose()
    assert closed.is_closed


async def test_errors_from_the_source_propagate() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "a"
        raise RuntimeError("upstream broke")

    received: list[str] = []
    try:
        async for item in with_keepalive(failing(), interval_s=10, keepalive=PING):
            received.append(item)
    except RuntimeError as error:
        assert str(error) == "upstream broke"
    else:
        raise AssertionError("the error was swallowed")
    assert received == ["a"]
