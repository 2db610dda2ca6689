"""Run any ASGI app under a real uvicorn on a loopback port, in a thread with its own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import uvicorn

__all__ = ["ThreadedServer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadedServer:
    """`with ThreadedServer(app) as server: httpx.get(server.url + "/health/live")`; lifespan runs."""

    def __init__(self, app: Any, *, port: int | None = None, **config: Any) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"log_level": "warning", "lifespan": "on", "timeout_graceful_shutdown": 1, **config}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, **options))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not the main thread
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start (see the log above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(RuntimeError):
            self._thread.join(10)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
