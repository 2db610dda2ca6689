"""One engine per host: `unigate serve --workers N` runs each local deployment's engine once, in its own process.

    unigate serve (parent)
     ├── uvicorn workers 1..N: each local deployment is an EngineClient ──┐ the engine protocol over
     ├── one engine process per local deployment (gateway.engine_host) ◀──┘ <data_dir>/engine-<name>.sock
     └── the embedded redis-server (without UNIGATE_REDIS_URL)

The parent starts each engine process (`gateway.engine_host.main`) before the workers, waits until it accepts
connections (not until its model is loaded: meanwhile workers answer 503 `engine_loading` with Retry-After, as with
an in-process engine), and stops it after the workers have stopped. An engine process that dies is started again
(`EngineSupervisor`), after a pause that doubles with each quick failure up to `MAX_RESTART_DELAY_S`; meanwhile the
workers answer 503 `engine_error` with Retry-After.

The engine process runs in its own session, so a terminal's Ctrl-C reaches the parent and the workers only and
the engine outlives the workers' in-flight requests; it exits by itself if the parent disappears. Its socket is
owner-only; a path too long for a Unix socket falls back to a private temporary directory.
"""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

from gateway.routing_config import DeploymentConfig, RoutingConfig

__all__ = ["SETTINGS_ENV", "SPEC_ENV", "EngineProcess", "EngineStartError", "EngineSupervisor", "exit_with_parent"]

logger = logging.getLogger("unigate.engine")

SPEC_ENV = "UNIGATE__ENGINE_PROCESS"  # the child's instructions (JSON), from the parent
SETTINGS_ENV = "UNIGATE__RESOLVED_SETTINGS"  # the parent's resolved settings (JSON), as its workers get them
_MAX_UNIX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS
START_TIMEOUT_S = 120.0  # spawn → accepting connections (imports and the socket; the model loads after)
STOP_TIMEOUT_S = 30.0  # SIGTERM → exit, then SIGKILL
MAX_RESTART_DELAY_S = 30.0
_STABLE_S = 60.0  # an engine that ran this long before it died is restarted at once


class EngineStartError(RuntimeError):
    """An engine process exited or did not accept connections in time while starting."""


class EngineProcess:
    """The engine process of one local deployment, listening on `socket_path`."""

    def __init__(self, deployment: DeploymentConfig, socket_path: Path, settings_json: str) -> None:
        self.deployment = deployment
        self.socket_path = socket_path
        self._settings_json = settings_json
        self._process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def has_exited(self) -> bool:
        return self._process is None or self._process.poll() is not None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Spawn the process and return once it accepts connections; `EngineStartError` if it exits or does not
        within `timeout_s` (it is then killed)."""
        if _is_listening(self.socket_path):
            raise EngineStartError(
                f"an engine already listens on {self.socket_path}: another `unigate serve` uses this data directory "
                "(stop it, or give this one its own UNIGATE_DATA_DIR)"
            )
        ready_read, ready_write = os.pipe()
        spec = {
            "deployment": self.deployment.model_dump(mode="json"),
            "socket_path": str(self.socket_path),
            "ready_fd": ready_write,
            "parent_pid": os.getpid(),
        }
        env = {**os.environ, SETTINGS_ENV: self._settings_json, SPEC_ENV: orjson.dumps(spec).decode()}
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "gateway.engine_host.main"],
                env=env,
                pass_fds=(ready_write,),
                start_new_session=True,  # a terminal's Ctrl-C must not stop it before the workers
            )
        finally:
            os.close(ready_write)
        try:
            is_ready = _wait_readable(ready_read, self._process, timeout_s)
        finally:
            os.close(ready_read)
        if not is_ready:
            self.kill()
            code = self._process.returncode
            raise EngineStartError(
                f"the engine process of deployment {self.deployment.name!r} "
                + (f"exited with status {code}" if code is not None else f"did not start within {timeout_s:g} s")
                + " (its log lines above say why)"
            )
        self.started_at = time.monotonic()
        logger.info(
            "engine process %d serves deployment %s on %s", self._process.pid, self.deployment.name, self.socket_path
        )

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (the engine host shuts down gracefully), SIGKILL after `timeout_s`; the socket is removed."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine process %d did not stop within %g s; killing it", process.pid, timeout_s)
                self.kill()
        self.socket_path.unlink(missing_ok=True)

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()


class EngineSupervisor:
    """The engine processes of `unigate serve --workers N`: started before the workers, restarted when one dies,
    stopped after the workers."""

    def __init__(self, processes: list[EngineProcess], *, private_dir: Path | None = None) -> None:
        self.processes = processes
        self._private_dir = private_dir
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    @classmethod
    def for_routing(cls, routing: RoutingConfig, data_dir: Path, settings_json: str) -> EngineSupervisor | None:
        """One engine process per `type: local` deployment of `routing`; None when there is none."""
        deployments = [d for model in routing.models for d in model.deployments if d.type == "local"]
        if not deployments:
            return None
        data_dir.mkdir(parents=True, exist_ok=True)
        names = [_socket_name(d.name, i, deployments) for i, d in enumerate(deployments)]
        private_dir = None
        if any(len(str(data_dir.resolve() / name)) > _MAX_UNIX_SOCKET_PATH for name in names):
            private_dir = Path(tempfile.mkdtemp(prefix="unigate-"))  # owner-only, and short
        directory = private_dir or data_dir.resolve()
        processes = [
            EngineProcess(d, directory / name, settings_json) for d, name in zip(deployments, names, strict=True)
        ]
        return cls(processes, private_dir=private_dir)

    @property
    def sockets(self) -> dict[str, str]:
        """Deployment name → its engine's socket, for `Settings.with_engine_sockets`."""
        return {p.deployment.name: str(p.socket_path) for p in self.processes}

    def start(self) -> None:
        """Start every engine process (in turn; each returns once it accepts connections) and the monitor."""
        try:
            for process in self.processes:
                process.start()
        except BaseException:
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, name="unigate-engine-supervisor", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        """Stop restarting, then stop every engine process (after the workers: they may still be streaming)."""
        self._stopping.set()
        for process in self.processes:
            process.stop()  # first, so a start the monitor is waiting on ends too
        if self._monitor is not None:
            self._monitor.join()
            for process in self.processes:
                process.stop()  # one the monitor started meanwhile
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)

    def _watch(self) -> None:
        delays = {id(p): 0.0 for p in self.processes}
        while not self._stopping.wait(0.5):
            for process in self.processes:
                if not process.has_exited():
                    continue
                ran_s = time.monotonic() - process.started_at
                delay = 0.0 if ran_s >= _STABLE_S else min(max(2 * delays[id(process)], 1.0), MAX_RESTART_DELAY_S)
                delays[id(process)] = delay
                logger.error(
                    "the engine process of deployment %s stopped after %.0f s; starting it again in %.0f s",
                    process.deployment.name,
                    ran_s,
                    delay,
                )
                if self._stopping.wait(delay):
                    return
                try:
                    process.start()
                except Exception as exc:  # e.g. EngineStartError: try again, after a longer pause
                    process.started_at = time.monotonic()
                    logger.error("restarting the engine failed: %s", exc)


def _socket_name(name: str, index: int, deployments: list[DeploymentConfig]) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40]
    slugs = [re.sub(r"[^A-Za-z0-9._-]+", "_", d.name)[:40] for d in deployments]
    return f"engine-{slug}.sock" if slugs.count(slug) == 1 else f"engine-{index}-{slug}.sock"


def _is_listening(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _wait_readable(fd: int, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """True once the child writes its ready byte; False if it closes the pipe (exited) or the time runs out."""
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return bool(readable) and os.read(fd, 1) == b"1" and process.poll() is None


def exit_with_parent(parent_pid: int) -> None:
    """Shut down (as on SIGTERM) when the parent is gone, e.g. killed with SIGKILL, rather than hold the model's
    memory (an engine) or the port (a worker) for nobody."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="unigate-parent-watch", daemon=True).start()
