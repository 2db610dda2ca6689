"""The transport between the workers and the engine process, alone: the engine protocol's clients, and the HTTP +
SSE transport it replaced (issue 37).

    .venv/bin/python benchmarks/engine_transport.py [--rounds 3] [--concurrency 1,16] [--chunks 64,1]
        [--code old=/tmp/old-checkout,new=.]

The engine host, in a process of its own under uvloop (as the engine process runs), serves a fake backend that
streams `--chunks` chunks of a typical size per call with nothing between them, so what is measured is the
transport: framing, the socket, both event loops. Clients, in another process (uvloop, as a worker):

- `pooled`: `backends.engine_client.EngineClient` as shipped: one connection per call, taken from a pool of idle
  ones and given back at the call's end, the call's coroutine reading its own frames;
- `multiplexed`: every call on one connection, as vLLM's AsyncLLM does over ZMQ: one reader task hands each frame
  to its call's queue (written here, for the comparison);
- `http`: a checkout from before issue 37 (`gateway.engine_server` present): the engine server's `/engine/stream`
  under uvicorn, and that checkout's `EngineClient` (aiohttp, SSE).

Each measurement runs in a fresh process with its checkout first on `PYTHONPATH` (`--code NAME=DIR`; default this
one); rounds alternate the order. Printed per level: chunks/s (median, min–max), and CPU µs per chunk in the
host process and in the client process (medians); with `--chunks 1`, the cost of a whole call.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import uvloop

CHUNK = {
    "id": "chatcmpl-5f0c2b1e9a7d4c3b8e6f1a2b3c4d5e6f",
    "object": "chat.completion.chunk",
    "created": 1733100000,
    "model": "smollm2-135m-instruct",
    "choices": [{"index": 0, "delta": {"content": " hello"}, "logprobs": None, "finish_reason": None}],
}
BODY = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 64}


class FakeBackend:
    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks

    async def stream(
        self, endpoint: str, body: Any, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> AsyncIterator[Any]:
        for _ in range(self.num_chunks):
            await asyncio.sleep(0)  # an engine step hands each chunk over on its own loop iteration
            yield CHUNK

    async def send(self, endpoint: str, body: Any, *, request_id: str, headers: Any = None, tenancy: Any = None) -> Any:
        return {}

    async def count_prompt_tokens(self, body: Any) -> int:
        return 1

    def health_state(self) -> Any:
        return "up"

    def output_limits(self) -> Any:
        from backends.base import OutputLimits

        return OutputLimits(2048, True, None)

    def stats(self) -> dict[str, Any]:
        return {}


def host_main(kind: str, path: str, num_chunks: int, ready: Any) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    backend = FakeBackend(num_chunks)
    if kind == "http":  # before issue 37: the engine server's protocol routes under uvicorn
        import uvicorn
        from gateway.engine_server import _EngineProtocol
        from starlette.applications import Starlette

        app = Starlette()
        app.state.router = SimpleNamespace(deployments=[SimpleNamespace(backend=backend)])

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                ready.set()

        config = uvicorn.Config(_EngineProtocol(app, api_key=None), log_level="warning", lifespan="off", loop="uvloop")
        Server(config).run(sockets=[sock])
        return

    from gateway.engine_host.host import EngineHost

    async def serve() -> None:
        await EngineHost(backend).start(sock)
        ready.set()
        await asyncio.Event().wait()

    uvloop.run(serve())


class Multiplexed:
    """Every call on one connection; a reader task demultiplexes frames by call id."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ids = itertools.count()
        self.calls: dict[int, asyncio.Queue[Any]] = {}
        self.connection: asyncio.Task[asyncio.StreamWriter] | None = None  # opened once, by the first call
        self.reader_task: asyncio.Task[None] | None = None

    async def _connect(self) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_unix_connection(self.path)
        self.reader_task = asyncio.get_running_loop().create_task(self._read(reader))
        return writer

    async def stream(self) -> AsyncIterator[Any]:
        from backends.engine_protocol import AddRequest, Finished, encode

        if self.connection is None:
            self.connection = asyncio.get_running_loop().create_task(self._connect())
        writer = await self.connection
        call_id = next(self.ids)
        queue = self.calls[call_id] = asyncio.Queue()
        writer.write(encode(AddRequest(call_id, "r", "chat/completions", True, BODY)))
        try:
            while not isinstance(message := await queue.get(), Finished):
                yield message
        finally:
            del self.calls[call_id]

    async def _read(self, reader: asyncio.StreamReader) -> None:
        from backends.engine_protocol import read_message

        while (message := await read_message(reader)) is not None:
            queue = self.calls.get(message.call_id)
            if queue is not None:
                queue.put_nowait(message)

    async def aclose(self) -> None:
        if self.connection is not None and self.reader_task is not None:
            (await self.connection).close()
            self.reader_task.cancel()


class Pooled:
    """The checkout's own `EngineClient` (pooled connections after issue 37, aiohttp before)."""

    def __init__(self, path: str) -> None:
        from backends.engine_client import EngineClient, EngineClientConfig

        self.client = EngineClient(EngineClientConfig("bench", socket_path=path, poll_interval_s=3600))

    def stream(self) -> AsyncIterator[Any]:
        return self.client.stream("chat/completions", BODY, request_id="r")

    async def aclose(self) -> None:
        await self.client.aclose()


async def drive(kind: str, path: str, concurrency: int, num_calls: int) -> tuple[float, float]:
    """(seconds, client CPU seconds) for `num_calls` calls, `concurrency` at a time."""
    client: Pooled | Multiplexed = Multiplexed(path) if kind == "multiplexed" else Pooled(path)
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            async for _ in client.stream():
                pass

    await asyncio.gather(*(one() for _ in range(concurrency)))  # connections opened, loops warm
    started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(one() for _ in range(num_calls)))
    elapsed, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    await client.aclose()
    return elapsed, (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)


def measure(kind: str, concurrency: int, num_chunks: int, num_calls: int) -> dict[str, float]:
    """One measurement in this process (and a host process of its own)."""
    with tempfile.TemporaryDirectory(prefix="ug-transport-") as directory:
        path = str(Path(directory) / "engine.sock")
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        host = context.Process(target=host_main, args=(kind, path, num_chunks, ready))
        host.start()
        try:
            ready.wait(60)
            host_process = psutil.Process(host.pid)
            before = sum(host_process.cpu_times()[:2])
            elapsed, client_cpu_s = uvloop.run(drive(kind, path, concurrency, num_calls))
            host_cpu_s = sum(host_process.cpu_times()[:2]) - before
        finally:
            host.kill()
            host.join()
    num = num_calls * num_chunks
    return {"rate": num / elapsed, "host_us": host_cpu_s / num * 1e6, "client_us": client_cpu_s / num * 1e6}


def measure_in(directory: str, kind: str, concurrency: int, num_chunks: int, num_calls: int) -> dict[str, float]:
    """`measure` in a fresh process, `directory` first on its PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(Path(directory).resolve())}
    argv = [sys.executable, __file__, "--measure", kind, str(concurrency), str(num_chunks), str(num_calls)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--chunks", default="64,1", help="chunks per call, comma-separated")
    parser.add_argument("--calls", type=int, default=400, help="measured calls per level (x16 with 1 chunk)")
    parser.add_argument("--code", default="", help="NAME=DIR,... checkouts to compare (default: this one)")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)  # (internal) one measurement, as JSON
    args = parser.parse_args()
    if args.measure:
        kind, concurrency, num_chunks, num_calls = args.measure
        print(json.dumps(measure(kind, int(concurrency), int(num_chunks), int(num_calls))))
        return
    codes = [(name, path) for name, _, path in (item.partition("=") for item in args.code.split(",") if item)]
    contenders = [
        (f"{name}: {kind}", path)
        for name, path in codes or [("this", str(Path(__file__).resolve().parent.parent))]
        for kind in (["pooled", "multiplexed"] if (Path(path) / "gateway" / "engine_host").is_dir() else ["http"])
    ]
    figures: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for round_index in range(args.rounds):
        shift = round_index % len(contenders)
        for num_chunks in map(int, args.chunks.split(",")):
            num_calls = args.calls * (16 if num_chunks == 1 else 1)
            for concurrency in map(int, args.concurrency.split(",")):
                for label, path in contenders[shift:] + contenders[:shift]:
                    row = measure_in(path, label.rsplit(" ", 1)[-1], concurrency, num_chunks, num_calls)
                    figures.setdefault((num_chunks, concurrency, label), []).append(row)
                    print(f"round {round_index}: {num_chunks} chunks/call, c={concurrency}, {label}: {row}", flush=True)
    print(f"\nhost: {os.cpu_count()} CPUs; medians of {args.rounds} rounds\n")
    print("| chunks/call | c | transport | chunks/s (min–max) | host µs/chunk | client µs/chunk |")
    print("|---:|---:|---|---:|---:|---:|")
    for (num_chunks, concurrency, label), rows in sorted(figures.items()):
        rates = [row["rate"] for row in rows]
        host_us, client_us = (statistics.median(row[key] for row in rows) for key in ("host_us", "client_us"))
        print(
            f"| {num_chunks} | {concurrency} | {label} | {statistics.median(rates):.0f} "
            f"({min(rates):.0f}–{max(rates):.0f}) | {host_us:.1f} | {client_us:.1f} |"
        )


if __name__ == "__main__":
    main()
