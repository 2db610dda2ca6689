"""`ClusterCommandPipe`: the hot path's commands on a Redis Cluster, one auto-pipelined `CommandPipe` per node.

Every command names the key it routes by (the first key of a script call: all of a script's keys share one hash tag,
so one slot). The command goes to the pipe of the primary serving that slot, as redis-py's cluster client last
mapped it. Redirections are followed, never reported as an outage:

- `MOVED <slot> <host:port>` (the slot moved for good, e.g. after a failover or resharding): the command is sent
  again to the new owner, later commands of that slot follow it, and the client's slot map is refreshed in the
  background;
- `ASK <slot> <host:port>` (the slot is being migrated and the key is already on the target): `ASKING` and the
  command are sent to the target together, on its one connection, so nothing can come between them.

- `TRYAGAIN` (a script's keys are split between the two nodes while the slot migrates): the command is sent again
  after `_TRYAGAIN_DELAY_S`, as redis-py's cluster client does.

After `_MAX_ATTEMPTS` the last reply reaches the caller (`classify_failure` makes it a `StorageError`).
A connection failure or timeout fails the commands of that node's batch (as with one `CommandPipe`) and refreshes
the slot map in the background, so that once the cluster has promoted a replica the next commands go there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from auth.resp_pipe import CommandPipe

__all__ = ["ClusterCommandPipe", "make_pipe"]

_MAX_ATTEMPTS = 20  # MOVED / ASK / TRYAGAIN replies followed per command
_TRYAGAIN_DELAY_S = 0.05
_Args = Callable[[], tuple[EncodableT, ...]]


class _NodeClient:
    """What `CommandPipe` reads of a client (`connection_pool.connection_class` / `.connection_kwargs`), for one
    node of the cluster, with the options the cluster client gives its own connections to that node."""

    def __init__(self, cluster: RedisCluster, address: str) -> None:
        kwargs = dict(cluster.get_connection_kwargs())
        connection_class = kwargs.pop("connection_class")
        for name in ("max_connections", "response_callbacks"):
            kwargs.pop(name, None)
        host, _, port = address.rpartition(":")
        kwargs.update(host=host, port=int(port), retry=Retry(NoBackoff(), 0))
        self.connection_pool = SimpleNamespace(connection_class=connection_class, connection_kwargs=kwargs)


def _routing_key(args: tuple[EncodableT, ...]) -> EncodableT:
    """The key a command routes by: EVALSHA sha numkeys key... → the first key; CMD key ... → key."""
    if str(args[0]).upper() in ("EVALSHA", "EVAL"):
        if int(args[2]) < 1:
            raise ValueError("a script call without keys cannot be routed in a cluster")
        return args[3]
    return args[1]


def _slot(key: EncodableT) -> int:
    return key_slot(key if isinstance(key, bytes) else str(key).encode())


class ClusterCommandPipe:
    """The `CommandPipe` interface (`submit`, `execute`, `evalsha`, `script_load`, `disconnect`, `aclose`) over a
    cluster; see the module docstring."""

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        self._pipes: dict[str, CommandPipe] = {}  # "host:port" -> the node's pipe
        self._moved: dict[int, str] = {}  # slot -> "host:port", learned from MOVED since the last refresh
        self._refresh: asyncio.Task[None] | None = None
        self._is_ready = False
        self._starting: set[asyncio.Task[None]] = set()  # commands waiting for the first slot map
        self.num_redirects = 0

    # -- routing -----------------------------------------------------------------------------------------------

    def _pipe(self, address: str) -> CommandPipe:
        pipe = self._pipes.get(address)
        if pipe is None:
            pipe = self._pipes[address] = CommandPipe(_NodeClient(self._cluster, address))  # type: ignore[arg-type]
        return pipe

    def _owner(self, slot: int) -> str:
        address = self._moved.get(slot)
        if address is not None:
            return address
        nodes = self._cluster.nodes_manager.slots_cache.get(slot)
        if not nodes:
            raise RedisError(f"no node of the cluster serves slot {slot} (the cluster is down or resharding)")
        return str(nodes[0].name)

    def _refresh_slots(self) -> None:
        """Re-read the slot map (in the background, one refresh at a time); MOVED overrides end with it."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._reload(), name="unigate-cluster-slots")

    async def _reload(self) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self._cluster.nodes_manager.initialize()
            self._moved.clear()

    # -- the CommandPipe interface -----------------------------------------------------------------------------

    def submit(self, build_args: _Args, *, key: EncodableT | None = None) -> asyncio.Future[Any]:
        """Queue a command on the pipe of the node serving `key` (by default the command's own first key, which
        builds the arguments now; pass `key` to keep them open until the batch is written)."""
        loop = asyncio.get_running_loop()
        outer: asyncio.Future[Any] = loop.create_future()
        built: list[tuple[EncodableT, ...]] = []

        def build_once() -> tuple[EncodableT, ...]:
            if not built:
                built.append(build_args())
            return built[0]

        if key is None:
            key = _routing_key(build_once())
        if self._is_ready:
            self._send(outer, build_once, _slot(key), 0, asking=None)
        else:
            task = loop.create_task(self._send_when_ready(outer, build_once, _slot(key)))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)
        return outer

    async def _send_when_ready(self, outer: asyncio.Future[Any], build: _Args, slot: int) -> None:
        try:
            await self._cluster.initialize()
        except (RedisError, OSError, TimeoutError) as exc:
            if not outer.done():
                outer.set_exception(exc)
            return
        self._is_ready = True
        self._send(outer, build, slot, 0, asking=None)

    def _send(self, outer: asyncio.Future[Any], build: _Args, slot: int, attempt: int, asking: str | None) -> None:
        if outer.done():  # cancelled while waiting to try again
            return
        try:
            address = asking or self._owner(slot)
        except RedisError as exc:
            self._refresh_slots()
            outer.set_exception(exc)
            return
        pipe = self._pipe(address)
        if asking is not None:
            # Queued back to back on the target's one connection: ASKING applies to the very next command.
            pipe.submit(lambda: ("ASKING",)).add_done_callback(_ignore)
        inner = pipe.submit(build)
        inner.add_done_callback(functools.partial(self._on_reply, outer, build, slot, attempt))

    def _on_reply(
        self, outer: asyncio.Future[Any], build: _Args, slot: int, attempt: int, inner: asyncio.Future[Any]
    ) -> None:
        if outer.done():
            if not inner.cancelled():
                inner.exception()
            return
        if inner.cancelled():
            outer.cancel()
            return
        exc = inner.exception()
        if exc is None:
            outer.set_result(inner.result())
            return
        if isinstance(exc, AskError | TryAgainError) and attempt < _MAX_ATTEMPTS:
            self.num_redirects += 1
            if isinstance(exc, TryAgainError):
                retry = functools.partial(self._send, outer, build, slot, attempt + 1, None)
                asyncio.get_running_loop().call_later(_TRYAGAIN_DELAY_S, retry)
            elif isinstance(exc, MovedError):
                self._moved[exc.slot_id] = f"{exc.host}:{exc.port}"
                self._refresh_slots()
                self._send(outer, build, slot, attempt + 1, asking=None)
            else:
                self._send(outer, build, slot, attempt + 1, asking=f"{exc.host}:{exc.port}")
            return
        if _is_connection_failure(exc):
            self._refresh_slots()
        outer.set_exception(exc)

    async def execute(self, *args: EncodableT) -> Any:
        return await self.submit(lambda: args)

    async def evalsha(self, sha: str, num_keys: int, *keys_and_args: EncodableT) -> Any:
        return await self.execute("EVALSHA", sha, num_keys, *keys_and_args)

    async def script_load(self, source: str) -> Any:
        """Register a script on every primary (a script call may go to any of them)."""
        if not self._is_ready:
            await self._cluster.initialize()
            self._is_ready = True
        primaries = {str(node.name) for node in self._cluster.get_primaries()}
        replies = await asyncio.gather(
            *(self._pipe(address).execute("SCRIPT", "LOAD", source) for address in primaries)
        )
        return replies[0] if replies else None

    async def disconnect(self) -> None:
        for pipe in list(self._pipes.values()):
            await pipe.disconnect()
        self._refresh_slots()

    async def aclose(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh
        pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            await pipe.aclose()


def make_pipe(redis: Redis | RedisCluster) -> CommandPipe | ClusterCommandPipe:
    """The hot path's pipe for a client: one connection, or one per node of a cluster."""
    return ClusterCommandPipe(redis) if isinstance(redis, RedisCluster) else CommandPipe(redis)


def _ignore(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _is_connection_failure(exc: BaseException) -> bool:
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | ClusterDownError | OSError | TimeoutError)
