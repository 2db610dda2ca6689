"""One embedded Redis per data directory (issue 22): a second owner is refused with a clear message, never a second
redis-server on the same AOF, and the directory is free again once its owner stops or dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis as sync_redis

from auth.embedded_redis import DataDirInUseError, EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_owner_is_refused_and_the_first_keeps_serving(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path)
    url = first.start()
    try:
        second = EmbeddedRedis(tmp_path)
        with pytest.raises(DataDirInUseError, match=rf"in use by another unigate process \(pid {os.getpid()}\)"):
            second.start()
        assert not second.is_running
        client = sync_redis.Redis.from_url(url)
        try:
            assert client.ping()  # the refused start touched neither the server nor its socket
        finally:
            client.close()
    finally:
        first.stop()
    again = EmbeddedRedis(tmp_path)  # stopped: the directory is free
    again.start()
    again.stop()


def test_the_lock_dies_with_its_owner(tmp_path: Path) -> None:
    """An owner killed with SIGKILL leaves no stale lock (the kernel drops it), so a restart needs no clean-up."""
    script = (
        "import sys, time; from pathlib import Path; from auth.embedded_redis import EmbeddedRedis; "
        f"s = EmbeddedRedis(Path({str(tmp_path)!r})); s.start(); print('up', flush=True); time.sleep(60)"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
        with pytest.raises(DataDirInUseError, match=rf"pid {owner.pid}"):
            EmbeddedRedis(tmp_path).start()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    survivor = EmbeddedRedis(tmp_path)
    survivor.start()  # attaches to the orphaned server (or starts one): either way, one server on the AOF
    try:
        assert sync_redis.Redis.from_url(survivor.url).ping()
    finally:
        survivor.stop()
        _stop_orphan(tmp_path)


def _stop_orphan(data_dir: Path) -> None:
    """The SIGKILLed owner's redis-server outlived it; shut it down so the test leaves no process behind."""
    client = sync_redis.Redis.from_url(f"unix://{data_dir.resolve() / 'redis.sock'}", socket_timeout=2)
    try:
        client.shutdown(nosave=True)
    except (sync_redis.ConnectionError, OSError):
        pass
    finally:
        client.close()


@pytest.mark.parametrize(
    ("workers", "master_key"),
    [("1", "sk-ug-master-lock-test-0123456789"), ("2", "sk-ug-master-lock-test-0123456789"), ("1", "")],
)
def test_unigate_serve_on_a_directory_in_use_exits_with_the_fix(tmp_path: Path, workers: str, master_key: str) -> None:
    """Refused before it does anything there: without UNIGATE_MASTER_KEY it must not generate and store a key
    (the running owner's clients would then read a key that matches nothing)."""
    owner = EmbeddedRedis(tmp_path / "data")
    owner.start()
    try:
        env = {name: value for name, value in os.environ.items() if not name.startswith("UNIGATE_")}
        env |= {
            "UNIGATE_DATA_DIR": str(tmp_path / "data"),
            "UNIGATE_PORT": "0",
            "UNIGATE_WORKERS": workers,
            "UNIGATE_ENGINE__ENABLED": "false",
        }
        if master_key:
            env["UNIGATE_MASTER_KEY"] = master_key
        result = subprocess.run(
            [sys.executable, "-c", "from gateway.cli import main; main()", "serve"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        owner.stop()
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"is in use by another unigate process (pid {os.getpid()})" in result.stderr
    assert "UNIGATE_DATA_DIR" in result.stderr and "UNIGATE_REDIS_URL" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data" / "master_key").exists() and "generated a master key" not in result.stderr
