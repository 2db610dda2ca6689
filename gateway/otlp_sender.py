"""The span sender: a child process that posts the gateway's encoded span batches to the OTLP collector.

    parent (gateway worker)                     child (python -m gateway.otlp_sender)
    event loop ───── frame: 4-byte length ──▶   stdin ──▶ OTLP protobuf ──▶ the SDK's OTLP/HTTP client ──▶ collector
                     + the batch's traces   (non-blocking pipe)   (otlp_encoding)
                       (one pickle each)

Why a process: posting a batch from a thread of the gateway (HTTP client, urllib3, TLS) cost the event loop ~35 µs
per traced request at c=32, in the post itself and in the GIL hand-offs around its socket calls, and encoding the
spans on the loop ~10 µs more; pickling a trace's span rows (one C call, ~3 µs) and writing batches to a pipe
costs a few. The
child encodes (gateway/otlp_encoding.py, under the resource it reads from `OTEL_SERVICE_NAME` /
`OTEL_RESOURCE_ATTRIBUTES`) and sends with the SDK's own client, so the `OTEL_EXPORTER_OTLP_*` endpoint, headers,
timeout, compression, certificates and retries are read and honoured exactly as the SDK does.

The child is started on the first batch and ends when its stdin closes (the gateway's shutdown, or the gateway
dying), after sending what it has read. If it dies, what it had not read is lost, and the next batch starts a new
one, at most one start per `restart_after_s` (5 s); a batch refused meanwhile is counted as dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["SenderProcess", "lean_exporter", "main", "pickle_trace", "resource_attributes", "unpickle_batch"]

logger = logging.getLogger("unigate.tracing")

_LENGTH = struct.Struct(">I")
_RESTART_AFTER_S = 5.0
_STOP_TIMEOUT_S = 30.0  # a stop waits this long for the child to send what it has (its own timeout is 10 s a post)
_ROOT = Path(__file__).resolve().parent.parent  # the directory holding the `gateway` package


class SenderProcess:
    """The parent's end: `send(frame)` queues one batch for the child (starting it when needed) and never blocks the
    event loop: the pipe is non-blocking, what it cannot take now waits in a buffer (at most `max_pending_bytes`;
    past that a batch is refused) and is written when the loop says the pipe is writable. `close()` ends the child
    after it has sent everything written."""

    def __init__(
        self,
        environ: Mapping[str, str],
        *,
        restart_after_s: float = _RESTART_AFTER_S,
        max_pending_bytes: int = 16 << 20,
    ) -> None:
        # The child reads its configuration from the same OTEL_* variables the gateway was given.
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self._env.update({k: v for k, v in environ.items() if k.startswith("OTEL_")})
        self._env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), self._env.get("PYTHONPATH")]))
        self._process: subprocess.Popen[bytes] | None = None
        self._restart_after_s = restart_after_s
        self._last_start = -restart_after_s
        self._max_pending_bytes = max_pending_bytes
        self._pending = bytearray()  # written to the child as its pipe takes it
        self._writer_loop: asyncio.AbstractEventLoop | None = None  # where a writable-callback waits, if one does

    @property
    def pid(self) -> int | None:
        """The running child's process id (None: none runs now)."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def send(self, body: bytes) -> bool:
        """Queue one batch (`pickle_trace`'s, one after another) for the child; False when it cannot be taken (no
        child, or the child is that far behind)."""
        if not self._running():
            return False
        if len(self._pending) + _LENGTH.size + len(body) > self._max_pending_bytes:
            return False
        self._pending += _LENGTH.pack(len(body))
        self._pending += body
        self._write()
        return True

    def _running(self) -> bool:
        if self._process is not None and self._process.poll() is None:
            return True
        if self._process is not None:
            logger.warning("span sender process ended unexpectedly; a new one starts with a later batch")
            self._reap()
        if time.monotonic() - self._last_start < self._restart_after_s:
            return False
        self._last_start = time.monotonic()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "gateway.otlp_sender"], stdin=subprocess.PIPE, env=self._env
            )
        except OSError:
            logger.exception("cannot start the span sender process")
            return False
        assert self._process.stdin is not None
        os.set_blocking(self._process.stdin.fileno(), False)
        return True

    def _write(self) -> None:
        """Write what the pipe takes now; wait for the loop's word for the rest (no loop: block until written)."""
        process = self._process
        if process is None or process.stdin is None:
            self._pending.clear()
            return
        fd = process.stdin.fileno()
        try:
            while self._pending:
                try:
                    del self._pending[: os.write(fd, self._pending)]
                except BlockingIOError:
                    try:
                        loop = asyncio.get_running_loop()
                    except RuntimeError:  # not on a loop (a script, a test): wait for the child here
                        select.select([], [fd], [], 1.0)
                        continue
                    if self._writer_loop is None:
                        self._writer_loop = loop
                        loop.add_writer(fd, self._on_writable)
                    return
        except OSError:  # the child is gone: what it had not read is lost
            logger.warning("span sender process ended unexpectedly; a new one starts with a later batch")
            self._reap()
            return
        self._stop_waiting()

    def _on_writable(self) -> None:
        self._write()

    def _stop_waiting(self) -> None:
        loop, self._writer_loop = self._writer_loop, None
        process = self._process
        if loop is not None and process is not None and process.stdin is not None and not loop.is_closed():
            loop.remove_writer(process.stdin.fileno())

    def _reap(self) -> None:
        self._stop_waiting()
        self._pending.clear()
        process, self._process = self._process, None
        if process is not None:
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
            try:
                process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def close(self) -> None:
        """Write what waits (blocking: this is the stop), then end the child once it has sent it all (it stops
        reading at end of input)."""
        self._stop_waiting()
        process, pending = self._process, bytes(self._pending)
        self._process = None
        self._pending.clear()
        if process is None:
            return
        try:
            if process.stdin is not None:
                os.set_blocking(process.stdin.fileno(), True)
                if pending:
                    _write_all(process.stdin.fileno(), pending)
                process.stdin.close()
        except OSError:
            pass
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("span sender process did not finish within %.0f s; stopped", _STOP_TIMEOUT_S)
            process.kill()
            process.wait()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def pickle_trace(trace: Any) -> bytes:
    """One trace (`tracing.TraceSpans`) as the parent queues it: its pickle's length (4 bytes), then the pickle; a
    batch is such items one after another. Our own child reads them, nothing else."""
    data = pickle.dumps(trace, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def unpickle_batch(frame: bytes) -> list[Any]:
    """The traces of one frame (`pickle_trace`'s items, one after another)."""
    traces, at, view = [], 0, memoryview(frame)
    while at < len(frame):
        (size,) = _LENGTH.unpack_from(frame, at)
        traces.append(pickle.loads(view[at + _LENGTH.size : at + _LENGTH.size + size]))
        at += _LENGTH.size + size
    return traces


def resource_attributes(environ: Mapping[str, str]) -> bytes:
    """The encoded resource of the spans: the SDK's `Resource` (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, the
    SDK's own attributes), with `service.name` "unigate" unless the variables name one."""
    from opentelemetry.sdk.resources import Resource

    from gateway.otlp_encoding import encode_attributes

    resource = Resource.create({} if environ.get("OTEL_SERVICE_NAME") else {"service.name": "unigate"})
    return encode_attributes(dict(resource.attributes))


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def lean_exporter(environ: Mapping[str, str]) -> Any:
    """The SDK's OTLP/HTTP span exporter as the environment configures it, on its urllib3 transport rather than its
    default (requests: ~600 vs ~250 µs of CPU a post, measured here), with the TLS settings the default would read
    from the `OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE` / `CLIENT_KEY` / `CLIENT_CERTIFICATE` variables."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    try:
        from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    except ImportError:
        return OTLPSpanExporter()

    def setting(name: str) -> str | None:
        return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(f"OTEL_EXPORTER_OTLP_{name}")

    key, certificate = setting("CLIENT_KEY"), setting("CLIENT_CERTIFICATE")
    cert = (certificate, key) if certificate and key else certificate
    return OTLPSpanExporter(_transport=Urllib3HTTPTransport(verify=setting("CERTIFICATE") or True, cert=cert))


def main() -> None:
    """The child: read frames from stdin until it closes, post each one, then stop."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Signals to the gateway's process group (Ctrl-C, a service manager's stop) are the gateway's to handle: its
    # stop writes the last batches and then closes our input, and we end there (also when the gateway dies).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from gateway.tracing import otlp_batch

    exporter = lean_exporter(os.environ)
    encode = otlp_batch(resource_attributes(os.environ))
    stdin = sys.stdin.buffer
    try:
        while (header := _read_exactly(stdin, _LENGTH.size)) is not None:
            frame = _read_exactly(stdin, _LENGTH.unpack(header)[0])
            if frame is None:
                break
            try:
                # The exporter's client takes an encoded body (opentelemetry-exporter-otlp-proto-http 1.45, pinned
                # by the `otel` extra); `export()` would take the SDK's span objects, which these are not.
                exporter._client.export(encode(unpickle_batch(frame)))
            except Exception:  # the client logs its own failures; nothing may stop this loop
                logger.exception("span export failed")
    finally:
        exporter.shutdown()


if __name__ == "__main__":
    main()
