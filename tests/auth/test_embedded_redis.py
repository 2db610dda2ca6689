"""The embedded redis-server's files are private (security review, item 6), and an orphaned server that a new owner
attached to is stopped by that owner (issue 36)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as sync_redis

from auth.embedded_redis import EmbeddedRedis
from auth.master_key import resolve_master_key

ROOT = Path(__file__).resolve().parents[2]


def socket_client(data_dir: Path) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(f"unix://{data_dir.resolve() / 'redis.sock'}", socket_timeout=2)


def is_answering(data_dir: Path) -> bool:
    client = socket_client(data_dir)
    try:
        return bool(client.ping())
    except (sync_redis.ConnectionError, OSError):
        return False
    finally:
        client.close()


def has_exited(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its parent was killed; it runs no more)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def wait_until(condition: object, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def modes(directory: Path) -> dict[str, str]:
    """Every path under `directory` (itself included) whose mode lets anyone but its owner in: name → mode."""
    paths = [directory, *directory.rglob("*")]
    return {
        str(p.relative_to(directory)): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths if p.stat().st_mode & 0o077
    }


def test_the_data_directory_and_what_is_in_it_are_owner_only(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "appendonlydir").mkdir()  # as Redis 7 keeps its AOF; here left by an earlier start
    (data_dir / "appendonlydir" / "appendonly.aof.1.incr.aof").write_text("")
    (data_dir / "redis.log").write_text("an earlier start's log\n")
    (data_dir / "master_key").write_text("sk-ug-an-old-master-key-0123456789\n")
    for path in (data_dir, data_dir / "appendonlydir"):
        path.chmod(0o755)
    for path in (
        data_dir / "redis.log",
        data_dir / "master_key",
        data_dir / "appendonlydir" / "appendonly.aof.1.incr.aof",
    ):
        path.chmod(0o644)
    server = EmbeddedRedis(data_dir)
    server.start()
    try:
        client = socket_client(data_dir)
        try:
            client.set("ug:probe", "secret-ish")
            client.bgsave()  # the RDB too, not only the append-only file
            wait_until(lambda: client.info("persistence")["rdb_bgsave_in_progress"] == 0, "no snapshot written")
        finally:
            client.close()
        assert (data_dir / "redis.rdb").exists()
        assert modes(data_dir) == {}
    finally:
        server.stop()
    assert modes(data_dir) == {}


def test_the_master_key_file_is_owner_only_with_an_external_redis_too(tmp_path: Path) -> None:
    """With `UNIGATE_REDIS_URL` no embedded server touches the directory: the master key's start-up does."""
    fresh = tmp_path / "fresh"
    resolve_master_key(None, fresh, announce=lambda key, path: None)
    assert (fresh / "master_key").exists() and modes(fresh) == {}
    old = tmp_path / "old"
    old.mkdir(mode=0o700)
    (old / "master_key").write_text("sk-ug-written-by-hand-0123456789abcdef\n")
    (old / "master_key").chmod(0o644)
    assert resolve_master_key(None, old, announce=lambda key, path: None) == "sk-ug-written-by-hand-0123456789abcdef"
    assert modes(old) == {}


@pytest.fixture
def orphan(tmp_path: Path) -> Iterator[int]:
    """An embedded Redis on `tmp_path` whose owner process was killed with SIGKILL: the server's pid."""
    script = (
        "import sys, time; from pathlib import Path; from auth.embedded_redis import EmbeddedRedis; "
        f"s = EmbeddedRedis(Path({str(tmp_path)!r})); s.start(); print('up', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
        client = socket_client(tmp_path)
        try:
            pid = int(client.info("server")["process_id"])
            client.set("ug:written-before-the-crash", "kept")
        finally:
            client.close()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    try:
        yield pid
    finally:
        if not has_exited(pid):  # the test failed: leave no server behind
            os.kill(pid, signal.SIGKILL)


def test_a_clean_stop_shuts_down_the_orphaned_server_it_attached_to(tmp_path: Path, orphan: int) -> None:
    assert not has_exited(orphan) and is_answering(tmp_path)  # the server outlived its owner
    survivor = EmbeddedRedis(tmp_path)
    survivor.start()  # attaches: it answers on the socket, and the dead owner's lock is free
    assert not survivor.is_running  # it started nothing itself
    survivor.stop()
    assert not is_answering(tmp_path)
    wait_until(lambda: has_exited(orphan), "the orphaned redis-server is still running")

    again = EmbeddedRedis(tmp_path)  # the shutdown saved what the orphan held
    again.start()
    try:
        client = socket_client(tmp_path)
        try:
            assert client.get("ug:written-before-the-crash") == b"kept"
        finally:
            client.close()
    finally:
        again.stop()


def test_the_embedded_server_snapshots_and_appends(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    client = sync_redis.Redis.from_url(server.start())
    try:
        assert client.config_get("save") == {"save": "60 1"}  # RDB: a snapshot a minute after any write
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("k", "v")
    finally:
        client.close()
        server.stop()  # SIGTERM: with snapshots on, Redis writes the RDB file as it exits
    assert (tmp_path / "redis" / "redis.rdb").is_file()
