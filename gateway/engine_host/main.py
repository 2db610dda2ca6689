"""The engine process: `python -m gateway.engine_host.main`, started by `gateway.engine_host.process.EngineProcess`.

It holds one local deployment's engine and serves it to the workers over the engine protocol on an owner-only
Unix socket (`EngineHost`); it imports no web app. Its instructions come from the parent in the environment: the
parent's resolved settings (`SETTINGS_ENV`) and the deployment, socket path, ready pipe and parent pid
(`SPEC_ENV`).

Start-up, in order:
  1. settings, logging, the deployment;
  2. the socket is bound owner-only (it never exists with wider permissions);
  3. the local backend starts loading its model, in a thread;
  4. the host accepts connections, then the parent is told (one byte on its pipe).

Shutdown, on SIGTERM / SIGINT (from the parent, or from itself when the parent is gone):
  1. no new connections; calls that arrive now are answered 503 `server_shutting_down`;
  2. calls in flight may finish for `shutdown_grace_s` (the workers stopped first: normally none is left);
  3. the rest are cancelled (their engine requests aborted), the engine stops, the socket is removed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson

from backends.engine_protocol import MAX_FRAME_BYTES
from backends.local import LocalBackend
from gateway.deployments import local_config
from gateway.engine_host.host import EngineHost
from gateway.engine_host.process import SETTINGS_ENV, SPEC_ENV, exit_with_parent
from gateway.logging import configure_logging
from gateway.routing_config import DeploymentConfig
from gateway.settings import load_settings

__all__ = ["bind_owner_only", "main", "serve"]


def main() -> None:
    spec = orjson.loads(os.environ.pop(SPEC_ENV))
    settings = load_settings(**orjson.loads(os.environ.pop(SETTINGS_ENV)))
    configure_logging(settings.log_level, settings.log_format)
    deployment = DeploymentConfig.model_validate(spec["deployment"])
    path = Path(spec["socket_path"])
    sock = bind_owner_only(path)
    exit_with_parent(spec["parent_pid"])
    ready_fd: int = spec["ready_fd"]

    def notify_started() -> None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)

    backend = LocalBackend.from_local_config(local_config(deployment, settings))
    # Room for any body the workers accept (re-encoded compactly, it is no bigger) and their additions to it.
    max_frame_bytes = max(MAX_FRAME_BYTES, 2 * settings.max_body_bytes)
    try:
        _run(
            serve(
                backend,
                sock,
                grace_s=settings.shutdown_grace_s,
                max_frame_bytes=max_frame_bytes,
                on_started=notify_started,
            )
        )
    finally:
        path.unlink(missing_ok=True)


def bind_owner_only(path: Path) -> socket.socket:
    """A Unix socket bound at `path` with mode 0600 from the moment it exists (a stale file there is replaced: the
    parent checked that nothing listens on it)."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(previous_umask)
    return sock


async def serve(
    backend: LocalBackend,
    sock: socket.socket,
    *,
    grace_s: float,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    on_started: Callable[[], None] = lambda: None,
) -> None:
    """Serve `backend` on `sock` until SIGTERM / SIGINT, then shut down as the module docstring says."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    host = EngineHost(backend, max_frame_bytes=max_frame_bytes)
    await host.start(sock)
    on_started()
    await stop.wait()
    await host.shutdown(grace_s)
    await backend.aclose()


def _run(main: Coroutine[Any, Any, None]) -> None:
    if importlib.util.find_spec("uvloop") is not None:  # as the workers' uvicorn picks
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


if __name__ == "__main__":
    main()
