"""Connecting to Redis: one server, a Sentinel-watched primary or a Redis Cluster (the embedded redis-server that
serves a gateway without a URL is auth/embedded_redis.py), and what the rest of auth/ needs of a client whatever
its topology: a twin for blocking commands, a pub/sub subscription, a write probe.

`UNIGATE_REDIS_URL` forms (parsed by `parse_redis_url`):

    redis://[user:password@]host:port/db      one server (also rediss:// for TLS, unix:///path/to/redis.sock)
    redis+sentinel://[user:password@]host:port,host:port/service/db
                                              the primary of `service` as the listed Sentinels name it now; after a
                                              failover the next connection goes to the new primary
    redis+cluster://[user:password@]host:port,host:port/0
                                              a Redis Cluster reached through any of the listed nodes (db must be 0);
                                              commands go to the node serving their key's slot, MOVED/ASK followed
    (rediss+sentinel:// and rediss+cluster:// use TLS; credentials apply to the data nodes, not the Sentinels)
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import MaxConnectionsError, RedisError
from redis.typing import EncodableT

from auth import redis_names
from auth.redis_sentinel import sentinel_client

__all__ = [
    "RedisClient",
    "RedisTarget",
    "blocking_client",
    "connect",
    "disconnect_idle",
    "is_cluster",
    "is_writable",
    "parse_redis_url",
    "subscribe",
]

RedisClient = Redis | RedisCluster  # every function that takes a client takes either

_PROBE_TTL_MS = 60_000
_EXTRA_NODE_CONNECTIONS = 8


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where Redis is, as `UNIGATE_REDIS_URL` says: `url` for one server, else the Sentinels or cluster nodes."""

    kind: Literal["standalone", "sentinel", "cluster"]
    url: str = ""  # standalone only: handed to redis-py as is
    nodes: tuple[tuple[str, int], ...] = ()  # Sentinels (sentinel) or seed nodes (cluster)
    service: str = ""  # sentinel: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    is_tls: bool = False


def _url_error(url: str, detail: str) -> ValueError:
    scheme = url.partition("://")[0]
    return ValueError(
        f"Invalid UNIGATE_REDIS_URL ({scheme}://…): {detail}. Expected redis://host:port/db, "
        "redis+sentinel://host:port,host:port/service/db or redis+cluster://host:port,host:port/0."
    )


def _parse_nodes(url: str, netloc: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in netloc.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise _url_error(url, f"'{item}' is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """The topology a URL names (see the module docstring); ValueError with the expected forms otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise _url_error(url, "no scheme")
    base, _, topology = scheme.lower().partition("+")
    if base not in ("redis", "rediss", "unix") or topology not in ("", "sentinel", "cluster"):
        raise _url_error(url, f"unknown scheme '{scheme}'")
    if not topology:
        return RedisTarget(kind="standalone", url=url)
    if base == "unix":
        raise _url_error(url, "Sentinel and Cluster need host:port addresses")
    rest = rest.partition("?")[0].partition("#")[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    nodes = _parse_nodes(url, hosts)
    parts = [part for part in path.split("/") if part]
    if topology == "sentinel":
        if not parts:
            raise _url_error(url, "no service name after the Sentinel addresses")
        db = parts[1] if len(parts) > 1 else "0"
        if len(parts) > 2 or not db.isdigit():
            raise _url_error(url, "expected /service/db after the Sentinel addresses")
        return RedisTarget("sentinel", nodes=nodes, service=unquote(parts[0]), db=int(db), username=username,
                           password=password, is_tls=base == "rediss")  # fmt: skip
    if len(parts) > 1 or (parts and parts[0] != "0"):
        raise _url_error(url, "a Redis Cluster has only database 0")
    return RedisTarget("cluster", nodes=nodes, username=username, password=password, is_tls=base == "rediss")


@dataclass(frozen=True, slots=True)
class _ClientSpec:
    """How a client was made, so that `blocking_client` can make its twin."""

    target: RedisTarget
    timeout_s: float


_SPECS: weakref.WeakKeyDictionary[RedisClient, _ClientSpec] = weakref.WeakKeyDictionary()


class BoundedRedisCluster(RedisCluster):
    """A cluster client whose commands wait up to `max_wait_s` for one of `max_connections` connections, like the
    one-server blocking pool, instead of failing at once with MaxConnectionsError under a burst (redis-py's node
    pools do not block)."""

    def __init__(self, *, max_wait_s: float, max_connections: int, **kwargs: Any) -> None:
        # Each node's pool has room beyond the commands in flight for what holds a connection outside them (the
        # change feed's subscription, a pipeline).
        super().__init__(max_connections=max_connections + _EXTRA_NODE_CONNECTIONS, **kwargs)
        self._num_free = asyncio.Semaphore(max_connections)
        self._max_wait_s = max_wait_s

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        try:
            async with asyncio.timeout(self._max_wait_s):
                await self._num_free.acquire()
        except TimeoutError:
            raise MaxConnectionsError("every connection to the cluster is busy") from None
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            self._num_free.release()


def _fail_fast() -> Retry:
    return Retry(NoBackoff(), 0)


def connect(url: str, *, timeout_s: float = 1.0, max_connections: int = 64) -> RedisClient:
    """An asyncio client that fails fast: short socket timeouts and no client-side retries, so a dead Redis turns
    into an error within `timeout_s` instead of a hung request; the pool reconnects on the next call.

    The pool is bounded and blocking: a burst of requests queues for a connection (up to `timeout_s`) rather than
    opening one socket per request (redis-py's default pool raises past 100). A cluster client keeps such a pool
    per node; it follows MOVED/ASK itself and, after a connection error, refreshes its slot map and tries once more
    (the slot may have moved to a promoted replica)."""
    return _connect(
        parse_redis_url(url), timeout_s=timeout_s, read_timeout_s=timeout_s, max_connections=max_connections
    )


def _connect(target: RedisTarget, *, timeout_s: float, read_timeout_s: float, max_connections: int) -> RedisClient:
    client: RedisClient
    if target.kind == "standalone":
        pool = BlockingConnectionPool.from_url(
            target.url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=read_timeout_s,
            socket_connect_timeout=timeout_s,
            retry=_fail_fast(),
        )
        client = Redis.from_pool(pool)
    elif target.kind == "sentinel":
        sentinel_options: dict[str, object] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": _fail_fast(),
        }
        if target.is_tls:
            sentinel_options["ssl"] = True
        client = sentinel_client(
            list(target.nodes),
            target.service,
            sentinel_options=sentinel_options,
            db=target.db,
            username=target.username,
            password=target.password,
            ssl=target.is_tls,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=read_timeout_s,
            socket_connect_timeout=timeout_s,
            retry=_fail_fast(),
        )
    else:
        client = BoundedRedisCluster(
            max_wait_s=timeout_s,
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            username=target.username,
            password=target.password,
            ssl=target.is_tls,
            max_connections=max_connections,
            socket_timeout=read_timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    _SPECS[client] = _ClientSpec(target, timeout_s)
    return client


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


def blocking_client(client: RedisClient, *, read_timeout_s: float, max_connections: int) -> RedisClient:
    """A second client on the same Redis for blocking commands (BLPOP: one connection per waiter, so its pool is
    large), whose read timeout outlasts the blocking wait."""
    spec = _SPECS.get(client)
    if spec is not None:
        return _connect(
            spec.target, timeout_s=spec.timeout_s, read_timeout_s=read_timeout_s, max_connections=max_connections
        )
    assert isinstance(client, Redis), "a cluster client made outside connect()"
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["socket_timeout"] = read_timeout_s
    blocking_pool = ConnectionPool(connection_class=pool.connection_class, max_connections=max_connections, **kwargs)
    return Redis.from_pool(blocking_pool)


async def subscribe(client: RedisClient, channel: str) -> PubSub:
    """A pub/sub connection subscribed to `channel`. In a cluster a plain PUBLISH reaches every node, so the
    subscription goes to the node serving the channel's slot (the client's slot map is read first)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        node = client.get_node_from_key(channel)
        if node is None:
            raise RedisError(f"no node serves the slot of {channel} (the cluster is down or resharding)")
        pubsub: PubSub = client.pubsub(node=node)
    else:
        pubsub = client.pubsub()
    try:
        await pubsub.subscribe(channel)
    except BaseException:
        with contextlib.suppress(RedisError, OSError):
            await pubsub.aclose()  # type: ignore[no-untyped-call]
        raise
    return pubsub


async def disconnect_idle(client: RedisClient) -> None:
    """Drop the idle pooled connections of a client after a failure (each would fail once more before
    reconnecting). A cluster client needs nothing: it re-reads its slot map and reconnects after a failure."""
    if isinstance(client, Redis):
        with contextlib.suppress(RedisError, OSError):
            await client.connection_pool.disconnect(inuse_connections=False)


def _cluster_probe_keys(cluster: RedisCluster) -> list[str]:
    """One probe key per primary node: `ug:{health:<n>}` for the smallest n whose slot that node serves."""
    primaries = {node.name for node in cluster.get_primaries()}
    keys: dict[str, str] = {}
    for n in range(16 * max(len(primaries), 1) * 64):
        key = redis_names.health_probe(n)
        node = cluster.get_node_from_key(key)
        if node is None:
            raise RedisError(f"no node serves the slot of {key} (the cluster is down or resharding)")
        keys.setdefault(node.name, key)
        if primaries <= keys.keys():
            break
    return list(keys.values())


async def is_writable(client: RedisClient) -> bool:
    """Can the gateway write to Redis now? False for a read-only replica (a demoted primary), a cluster that is
    down or has a shard without a primary, a failover in progress, or no answer at all. In a cluster every primary
    is written to (one short-lived key each)."""
    try:
        if isinstance(client, RedisCluster):
            await client.initialize()
            for key in _cluster_probe_keys(client):
                await client.set(key, b"1", px=_PROBE_TTL_MS)
        else:
            await client.set(redis_names.health_probe(0), b"1", px=_PROBE_TTL_MS)
    except (RedisError, OSError, TimeoutError):
        return False
    return True


async def listen(
    client: RedisClient,
    channel: str,
    on_message: Callable[[bytes], None],
    *,
    is_closing: Callable[[], bool],
    on_resubscribed: Callable[[], None] = lambda: None,
) -> None:
    """Hand every message on `channel` to `on_message` until `is_closing()` (checked at least once a second).
    A lost subscription is made again with a backoff (0.1 s doubling to 2 s); `on_resubscribed` runs after each
    new subscription but the first, since messages in the gap were missed."""
    backoff_s = 0.1
    has_subscribed = False
    while not is_closing():
        pubsub = None
        try:
            pubsub = await subscribe(client, channel)
            if has_subscribed:
                on_resubscribed()
            has_subscribed = True
            backoff_s = 0.1
            while not is_closing():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None:
                    on_message(message["data"])
        except (TimeoutError, RedisError, OSError):
            pass
        finally:
            if pubsub is not None:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
        await asyncio.sleep(backoff_s)
        backoff_s = min(backoff_s * 2, 2.0)
