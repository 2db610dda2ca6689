"""`CommandPipe`: the hot path's Redis commands over one dedicated connection, auto-pipelined, with its own RESP
encoder (`encode_command`).

Only redis-py's public connection API is used: `connect`, `send_packed_command` (one call per batch) and
`read_response`. Writing to the connection's private stream writer instead, as this pipe once did, measured no
faster (benchmarks/redis_pipe.py; figures in benchmarks/RESULTS.md, 2026-12-02), so the public call was kept. The
connection is built without redis-py's socket timeout, under which every `send_packed_command` would start a
`wait_for` task (that did cost CPU); the pipe bounds each batch with one deadline of its own instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError, RedisError, ResponseError
from redis.typing import EncodableT

__all__ = ["CommandPipe", "encode_command"]


def encode_command(args: tuple[EncodableT, ...]) -> bytes:
    """One command in RESP. redis-py's `pack_command` spent ~10% of the gateway's CPU on the two Lua calls of a
    request (memoryview chunking, per-argument checks); the arguments here are short ids and numbers."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        # Exact types first (a settle batch has hundreds of arguments); bool is not int here.
        if type(arg) is str:
            data = arg.encode()
        elif type(arg) is int:
            data = b"%d" % arg
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int) and not isinstance(arg, bool):
            data = b"%d" % arg
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:  # the same refusal as redis-py's encoder (None, bool, other objects)
            raise DataError(f"Invalid input of type {type(arg).__name__} for a Redis command")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


_Args = Callable[[], tuple[EncodableT, ...]]  # a queued command's arguments, built when its batch is written


class CommandPipe:
    """Commands of the hot path over ONE dedicated connection, auto-pipelined: every command issued while a batch
    is on the wire is sent with the next batch in one write, and the replies are read back in order.

    Why: with the shared pool each script call paid a pool checkout (lock, condition, readiness probe), a write
    wrapped in a timeout task and a read, per command; under concurrency the gateway spent about a quarter of its
    CPU there. One connection in FIFO order also means a command issued after another is executed after it.

    A connection failure or timeout fails every command of the batch (callers see `RedisError`/`OSError`, as from
    the client); the next batch reconnects. An error reply (e.g. NOSCRIPT) fails only its own command.
    """

    def __init__(self, redis: Redis) -> None:
        pool = redis.connection_pool
        kwargs = dict(pool.connection_kwargs)
        self._timeout_s: float | None = kwargs.get("socket_timeout")
        # The pipe keeps its own deadline (one per batch) instead of the socket timeout, under which redis-py
        # would start a `wait_for` task for every write and a timeout context for every reply.
        if "socket_connect_timeout" in kwargs and kwargs["socket_connect_timeout"] is None:
            kwargs["socket_connect_timeout"] = self._timeout_s  # what redis-py would derive from it
        kwargs["socket_timeout"] = None
        self._connection: AbstractConnection = pool.connection_class(**kwargs)
        self._queue: list[tuple[_Args, asyncio.Future[Any]]] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._is_closing = False

    async def execute(self, *args: EncodableT) -> Any:
        return await self.submit(lambda: args)

    def submit(
        self, build_args: Callable[[], tuple[EncodableT, ...]], *, key: EncodableT | None = None
    ) -> asyncio.Future[Any]:
        """Queue a command now, in FIFO order with every other command, whose arguments are built only when its
        batch is written: until then the caller may still add to it (the settles of one key share one call).
        `key` is unused on one connection; a `ClusterCommandPipe` routes the command by it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((build_args, future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run(), name="unigate-redis-pipe")
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return future

    async def evalsha(self, sha: str, num_keys: int, *keys_and_args: EncodableT) -> Any:
        return await self.execute("EVALSHA", sha, num_keys, *keys_and_args)

    async def script_load(self, source: str) -> Any:
        return await self.execute("SCRIPT", "LOAD", source)

    async def disconnect(self) -> None:
        """Drop the connection (after a failure elsewhere: it would fail once more); the next batch reconnects."""
        if not self._queue and (self._worker is None or self._worker.done()):
            with contextlib.suppress(RedisError, OSError):
                await self._connection.disconnect(nowait=True)

    async def aclose(self) -> None:
        """Finish what was queued, then stop the worker and close the connection."""
        self._is_closing = True
        worker, self._worker = self._worker, None
        if worker is not None:
            if self._wakeup is not None and not self._wakeup.done():
                self._wakeup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker
        with contextlib.suppress(RedisError, OSError):
            await self._connection.disconnect(nowait=True)

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            queued, self._queue = self._queue, []
            for _, future in queued:
                if not future.done():
                    future.set_exception(RedisError("the Redis command pipe was closed"))

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._is_closing:  # a late command after aclose() was served: close again
                    with contextlib.suppress(RedisError, OSError):
                        await self._connection.disconnect(nowait=True)
                    return
                self._wakeup = loop.create_future()
                try:
                    await self._wakeup
                except asyncio.CancelledError:
                    if self._queue:
                        continue  # closing: serve what is still queued first
                    return
            batch, self._queue = self._queue, []
            try:
                await self._exchange(batch)
            except BaseException as exc:
                await self._connection.disconnect(nowait=True)
                failure = exc if isinstance(exc, Exception) else RedisError("the Redis command pipe was closed")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(failure)
                if not isinstance(exc, Exception):
                    raise

    async def _exchange(self, batch: list[tuple[_Args, asyncio.Future[Any]]]) -> None:
        """Write the batch in one write and read its replies in order, under one deadline: the socket timeout,
        for the connect (when there is none), the write and every reply together."""
        connection = self._connection
        async with asyncio.timeout(self._timeout_s):
            if not connection.is_connected:
                await connection.connect()  # type: ignore[no-untyped-call]
            # The arguments are built now: until here, callers could still add to a command (settles of one key).
            data = b"".join([encode_command(build_args()) for build_args, _ in batch])
            await connection.send_packed_command(data, check_health=False)
            for _, future in batch:
                try:
                    reply = await connection.read_response(timeout=math.inf)
                except ResponseError as error:  # an error reply: only this command failed
                    if not future.done():
                        future.set_exception(error)
                else:
                    if not future.done():
                        future.set_result(reply)
