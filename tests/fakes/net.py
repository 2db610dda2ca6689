"""Loopback networking helpers for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DelayingProxy:
    """A TCP proxy on loopback that holds every chunk a client sends for `delay_s` before passing it on (in order;
    replies pass at once): a slow link between one gateway instance and Redis, so what that instance writes lands
    later than what another instance writes directly.

        with DelayingProxy("127.0.0.1", 6379, delay_s=0.05) as proxy:  # proxy.port
    """

    def __init__(self, host: str, port: int, delay_s: float) -> None:
        self.target = (host, port)
        self.delay_s = delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.sockets: list[socket.socket] = []
        self.is_running = True

    def __enter__(self) -> DelayingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.is_running = False
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while self.is_running:
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, 0.0), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                if delay_s:
                    time.sleep(delay_s)
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
