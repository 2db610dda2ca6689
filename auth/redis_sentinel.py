"""A client on the primary of a Sentinel service that follows it through a failover without writing to the old one.

redis-py's Sentinel pool asks the Sentinels for the primary's address only when it opens a connection, and drops a
connection only when the server answers READONLY. A gateway holds its connections for a long time (the hot path
uses one connection for everything), and after a `SENTINEL FAILOVER` the old primary keeps accepting writes until
Sentinel gets round to demoting it, seconds later: writes that the promoted replica never sees, so admissions and
usage would be lost and limits exceeded. So this pool also watches the Sentinels:

- a failover starting (`+try-failover` for the service) closes every connection and refuses new ones
  (`MasterNotFoundError`, a connection error: the gateway's failure mode applies, and /health/ready says 503) until
  Sentinel names the new primary (`+switch-master`), the failover is aborted, or `_MAX_FAILOVER_S` passes;
- the new primary (`+switch-master`, or a changed answer to the poll it makes every `_POLL_S`, every quarter of
  that during a failover) closes every connection to any other server, so the next command goes there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.exceptions import RedisError

__all__ = ["SentinelPool", "SentinelRedis", "sentinel_client"]

_POLL_S = 1.0  # ask for the primary's address at least this often, in case an event was missed
_MAX_FAILOVER_S = 10.0  # a failover that neither ends nor aborts within this stops blocking connections
_FAILOVER_STARTS = {"+try-failover"}
_FAILOVER_ENDS = {"+switch-master", "-failover-abort-not-elected", "-failover-abort-no-good-slave",
                  "+failover-end-for-timeout"}  # fmt: skip


class SentinelConnection(SentinelManagedConnection):
    """Registers itself with its pool on connect, so that a failover can close it wherever it is used."""

    async def connect_to(self, address: Any) -> None:
        await super().connect_to(address)  # type: ignore[no-untyped-call]
        self.connection_pool.track(self)


class SentinelSSLConnection(SentinelConnection, SSLConnection):
    pass


class SentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The primary of a Sentinel service behind a bounded, blocking pool, with a task watching the Sentinels."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._connections_made: weakref.WeakSet[SentinelManagedConnection] = weakref.WeakSet()
        self._failover_until = 0.0
        self._known_address: tuple[str, int] | None = None
        self._failover_from: tuple[str, int] | None = None  # the primary when the failover in progress started
        self._watcher: asyncio.Task[None] | None = None
        self._is_stopping = False

    def track(self, connection: SentinelManagedConnection) -> None:
        self._connections_made.add(connection)

    @property
    def is_failing_over(self) -> bool:
        return time.monotonic() < self._failover_until

    async def get_master_address(self) -> Any:
        if not self._is_stopping and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="unigate-sentinel-watch")
        if self.is_failing_over:
            raise MasterNotFoundError(f"Sentinel is failing over {self.service_name!r}")
        address = await super().get_master_address()  # type: ignore[no-untyped-call]
        self._known_address = (str(address[0]), int(address[1]))
        return address

    async def stop_watching(self) -> None:
        """Stop the watcher. redis-py can swallow a cancellation that lands while it connects, so cancel again
        until the task ends (it also checks `_is_stopping` on every turn)."""
        self._is_stopping = True
        watcher, self._watcher = self._watcher, None
        deadline = time.monotonic() + 3.0
        while watcher is not None and not watcher.done() and time.monotonic() < deadline:
            watcher.cancel()
            await asyncio.wait({watcher}, timeout=0.1)

    async def _close_connections(self, *, keep: tuple[str, int] | None = None) -> None:
        for connection in list(self._connections_made):
            if keep is None or (connection.host, connection.port) != keep:
                with contextlib.suppress(RedisError, OSError):
                    await connection.disconnect()

    async def _on_event(self, channel: str, data: str) -> None:
        words = data.split()
        # "+try-failover master <name> <ip> <port>"; "+switch-master <name> <old ip> <old port> <new ip> <new port>";
        # the abort events name the master like +try-failover.
        name = words[0] if channel == "+switch-master" else (words[1] if len(words) > 1 else "")
        if name != self.service_name:
            return
        if channel in _FAILOVER_STARTS:
            self._failover_until = time.monotonic() + _MAX_FAILOVER_S
            self._failover_from = self._known_address
            await self._close_connections()
        elif channel in _FAILOVER_ENDS:
            self._failover_until = 0.0
            if channel == "+switch-master" and len(words) >= 5:
                await self._follow((words[3], int(words[4])))

    async def _follow(self, address: tuple[str, int]) -> None:
        if address != self._known_address:
            self._known_address = address
            await self._close_connections(keep=address)

    async def _poll(self) -> None:
        """Ask for the primary; during a failover, a primary other than the one it started from ends it (in case
        the event that says so was missed)."""
        with contextlib.suppress(RedisError, OSError):
            host, port = await self.sentinel_manager.discover_master(self.service_name)
            address = (str(host), int(port))
            if self.is_failing_over:
                if address == self._failover_from:
                    return
                self._failover_until = 0.0
            await self._follow(address)

    async def _watch(self) -> None:
        """Listen to one Sentinel's events (the next one after a failure), polling the address in between."""
        index = 0
        while not self._is_stopping:
            sentinel = self.sentinel_manager.sentinels[index % len(self.sentinel_manager.sentinels)]
            pubsub = sentinel.pubsub()
            try:
                await pubsub.subscribe(*_FAILOVER_STARTS, *_FAILOVER_ENDS)
                while not self._is_stopping:
                    timeout_s = _POLL_S / 4 if self.is_failing_over else _POLL_S
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
                    if message is not None:
                        await self._on_event(_text(message["channel"]), _text(message["data"]))
                    else:
                        await self._poll()
            except (RedisError, OSError):
                index += 1
                await self._poll()
                await asyncio.sleep(_POLL_S / 4)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SentinelRedis(Redis):
    """A client on the service's primary that, when closed, also stops its watcher and closes its Sentinel
    connections."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool = self.connection_pool
        if isinstance(pool, SentinelPool):
            await pool.stop_watching()
        await super().aclose(close_connection_pool)
        if isinstance(pool, SentinelConnectionPool):
            await pool.sentinel_manager.aclose()


def sentinel_client(
    sentinels: list[tuple[str, int]],
    service: str,
    *,
    sentinel_options: dict[str, Any],
    **connection_options: Any,
) -> SentinelRedis:
    """A `SentinelRedis` on `service`'s primary; `connection_options` go to its connections (db, password, ...)."""
    manager = Sentinel(sentinels, sentinel_kwargs=sentinel_options)  # type: ignore[no-untyped-call]
    is_tls = bool(connection_options.pop("ssl", False))
    client = manager.master_for(
        service,
        redis_class=SentinelRedis,
        connection_pool_class=SentinelPool,
        connection_class=SentinelSSLConnection if is_tls else SentinelConnection,
        **connection_options,
    )
    assert isinstance(client, SentinelRedis)
    return client
