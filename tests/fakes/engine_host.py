"""The real engine host (`gateway.engine_host.host.EngineHost`) on a Unix socket, for tests: in a thread with its
own event loop (`ThreadedEngineHost`, for sync tests and for clients in another loop), plus a tiny local backend
and a sync `get_state` that talks the protocol with no client in between."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from backends.config import LocalEngineOptions
from backends.engine_protocol import GetState, State, decode, encode
from backends.local import LocalBackend, LocalBackendConfig
from gateway.engine_host.host import EngineHost, HostedBackend
from gateway.engine_host.main import bind_owner_only

__all__ = ["ThreadedEngineHost", "get_state", "tiny_local_backend"]


def tiny_local_backend(model_path: Path, data_dir: Path, **engine: Any) -> LocalBackend:
    """A local backend on a tiny checkpoint, on CPU with a small KV cache; it starts loading now."""
    options = {
        "device": "cpu",
        "kv_cache_memory": 4 * 2**20,
        "max_num_seqs": 4,
        "cpu_kernels": False,
        "pack_cpu_weights": False,
    }
    options.update(engine)
    config = LocalBackendConfig(
        "local#0", model_id="tiny", cache_dir=data_dir, engine=LocalEngineOptions(model_path=str(model_path), **options)
    )
    return LocalBackend.from_local_config(config)


class ThreadedEngineHost:
    """`with ThreadedEngineHost(backend, path) as host:` serves `backend` on `path` until the block ends, then shuts
    down (no grace) and closes the backend."""

    def __init__(self, backend: HostedBackend, path: Path) -> None:
        self.backend = backend
        self.path = path
        self.loop = asyncio.new_event_loop()
        self.host = EngineHost(backend)
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-host", daemon=True)

    def __enter__(self) -> ThreadedEngineHost:
        self._thread.start()
        sock = bind_owner_only(self.path)
        asyncio.run_coroutine_threadsafe(self.host.start(sock), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        await self.host.shutdown(0)
        aclose = getattr(self.backend, "aclose", None)
        if aclose is not None:
            await aclose()


def get_state(path: Path, timeout_s: float = 10) -> State:
    """The host's own answer to `get_state` over a new connection (no worker in between, nothing cached)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(encode(GetState(0)))
        (size,) = struct.unpack(">I", _read_exactly(sock, 4))
        reply = decode(_read_exactly(sock, size))
    assert isinstance(reply, State), reply
    return reply


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise ConnectionError("the engine host closed the connection")
        data += part
    return data
