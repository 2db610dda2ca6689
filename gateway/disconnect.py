"""Cancel a call's upstream work when the client goes away before the response starts.

    with watch_disconnect(context.receive):          # in the pipeline: around `open_call`'s stream opening and
        data = await unless_disconnected(send)       # `Call.json()`; the attempts' upstream waits run under this

Once the response has started, `EventStreamResponse` watches the connection itself; before that the gateway may
wait minutes for an upstream (a long non-streaming generation, a slow first token), holding the upstream
connection, its `max_in_flight` lease and the caller's concurrency slot for nobody. Only the upstream waits are
cancelled (`gateway.attempt` and `gateway.pipeline` wrap them in `unless_disconnected`): admission and settlement
hold Redis reservations and must run to completion. The watch reaches the attempts through a context variable
because the router runs them (`Router.execute`) between the pipeline that opens the watch and the awaits it covers.

The watcher reads the ASGI receive channel, so it starts at the first `unless_disconnected` (after the route
read the body; none starts when nothing waits on an upstream) and is cancelled when the `watch_disconnect` block
ends, before the response reads the channel itself (uvicorn keeps a disconnect as connection state, so the
response still sees one that arrived meanwhile).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from starlette.types import Receive

from gateway.errors import ClientDisconnectedError

__all__ = ["DisconnectWatch", "unless_disconnected", "watch_disconnect"]

T = TypeVar("T")

_current: ContextVar[DisconnectWatch | None] = ContextVar("unigate_disconnect_watch", default=None)


class DisconnectWatch:
    """Watches one request's receive channel for `http.disconnect` and cancels the work running under `run()`."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        self._scopes: set[asyncio.Timeout] = set()
        self.is_disconnected = False

    async def run(self, work: Awaitable[T]) -> T:
        """`await work`; if the client disconnects first, `work` is cancelled (its own cleanup runs) and
        `ClientDisconnectedError` is raised."""
        if self.is_disconnected:
            if inspect.iscoroutine(work):
                work.close()
            raise _disconnected()
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        # asyncio.timeout(None) serves as a cancel scope: the watcher expires it on disconnect, which cancels
        # only this await (and `work` inside it), with asyncio's own cancel/uncancel bookkeeping.
        scope = asyncio.timeout(None)
        try:
            async with scope:
                self._scopes.add(scope)
                try:
                    return await work
                finally:
                    self._scopes.discard(scope)
        except TimeoutError:
            if scope.expired():
                raise _disconnected() from None
            raise

    def close(self) -> None:
        """Stop watching (the watcher task ends at the loop's next turn)."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass  # the body was read before the watch started: nothing else that arrives matters here
        except Exception:
            return  # the channel failed: nothing to watch (the response will notice the connection itself)
        self.is_disconnected = True
        now = asyncio.get_running_loop().time()
        for scope in list(self._scopes):
            scope.reschedule(now)


@contextmanager
def watch_disconnect(receive: Receive) -> Iterator[DisconnectWatch]:
    """Within the block, `unless_disconnected` (used by the pipeline) stops waiting when the client goes away."""
    watch = DisconnectWatch(receive)
    token = _current.set(watch)
    try:
        yield watch
    finally:
        _current.reset(token)
        watch.close()


async def unless_disconnected(work: Awaitable[T]) -> T:
    """`await work`, cancelled with `ClientDisconnectedError` when the client of the request being served goes
    away first; outside a `watch_disconnect` block it is a plain await."""
    watch = _current.get()
    if watch is None:
        return await work
    return await watch.run(work)


def _disconnected() -> ClientDisconnectedError:
    return ClientDisconnectedError(
        "The client closed the connection before the response started; the upstream request was cancelled."
    )
