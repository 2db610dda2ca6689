"""The hot path's Redis transport: `auth.resp_pipe.CommandPipe` against the alternatives it was chosen over.

    .venv/bin/python benchmarks/redis_pipe.py [--requests 3000] [--rounds 15] [--concurrency 1 32]

Each request is the two script calls of a gateway request (`admit_request`, then `settle_request` of its lease)
for a key with RPM/TPM/concurrency limits that are never reached, through the same typed wrappers
(`auth.scripts.admit_request` / `settle_requests`), against the embedded redis-server. Transports:

- `pipe`: `CommandPipe` as shipped: one connection, auto-pipelined, each batch written with redis-py's public
  `send_packed_command` on a connection without socket timeout, one deadline of the pipe's own per batch;
- `pipe, private writer`: the pipe as it was before 2026-12-02, writing each batch to the connection's private
  stream writer;
- `pipe, send under socket timeout`: `send_packed_command` on a connection with redis-py's socket timeout (a
  `wait_for` task per write);
- `redis-py evalsha`: `redis.asyncio.Redis.evalsha` on a connection pool (redis-py's own encoder, one pool
  checkout, write and read per call).

redis-py's `pipeline()` is not a contender: it sends what one caller queued, while the hot path's commands come
from independent requests (the pipe batches whatever was issued while a batch was on the wire).

Rounds alternate (the order rotates every round) so that a noisy neighbour hits every transport alike. Printed
per concurrency: wall time and this process' CPU time per script call, median over rounds, and the CPU minimum
(interference only adds to it); the Redis server runs in its own process, so the CPU figures are the client's
cost alone. Ratios are to `pipe`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from auth import scripts
from auth.embedded_redis import EmbeddedRedis
from auth.keys import hash_key, new_request_id
from auth.redis_client import connect
from auth.resp_pipe import CommandPipe, encode_command
from auth.store import KeyStore

LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}


_Batch = list[tuple[Callable[[], tuple[Any, ...]], asyncio.Future[Any]]]


class _SocketTimeoutPipe(CommandPipe):
    """`CommandPipe` on a connection with the pool's socket timeout, as redis-py builds it."""

    def __init__(self, redis: Redis) -> None:
        super().__init__(redis)
        pool = redis.connection_pool
        self._connection = pool.connection_class(**pool.connection_kwargs)

    async def _read_replies(self, batch: _Batch) -> None:
        async with asyncio.timeout(self._timeout_s):
            for _, future in batch:
                try:
                    future.set_result(await self._connection.read_response(timeout=math.inf))
                except ResponseError as error:
                    future.set_exception(error)


class PrivateWriterPipe(_SocketTimeoutPipe):
    """The pipe as it was before 2026-12-02: each batch written straight to the connection's private stream
    writer (draining, under the pipe's deadline, only past 64 KiB unsent), then one deadline for the replies."""

    async def _exchange(self, batch: _Batch) -> None:
        connection = self._connection
        if not connection.is_connected:
            await connection.connect()
        writer = connection._writer
        assert writer is not None
        writer.write(b"".join([encode_command(build_args()) for build_args, _ in batch]))
        if writer.transport.get_write_buffer_size() > 64 * 1024:
            async with asyncio.timeout(self._timeout_s):
                await writer.drain()
        await self._read_replies(batch)


class SocketTimeoutSendPipe(_SocketTimeoutPipe):
    """`send_packed_command` on a connection with a socket timeout: redis-py wraps every write in `wait_for`."""

    async def _exchange(self, batch: _Batch) -> None:
        data = b"".join([encode_command(build_args()) for build_args, _ in batch])
        await self._connection.send_packed_command(data, check_health=False)
        await self._read_replies(batch)


Transport = Redis | CommandPipe


async def one_request(transport: Transport, key_id: str, key_hash: str) -> None:
    lease_id = new_request_id()
    reply = await scripts.admit_request(
        transport,
        scripts.AdmitArgs(
            state_id=key_id,
            key_hash=key_hash,
            model="bench-model",
            estimated_tokens=300,
            request_id=lease_id,
            lease_ttl_ms=600_000,
            window_ms=60_000,
            cached_version=None,
        ),
    )
    assert reply.status == "ok", reply.status
    item = scripts.SettleItem(
        request_id=lease_id, reserved_tokens=300, prompt_tokens=100, completion_tokens=50, model="bench-model"
    )
    await scripts.settle_requests(
        transport, key_id=key_id, items=[item], window_ms=60_000, marker_ttl_ms=120_000, usage_retention_s=86_400
    )


async def timed(
    transport: Transport, key_id: str, key_hash: str, num_requests: int, concurrency: int
) -> tuple[float, float]:
    """(wall µs, CPU µs) per script call."""
    queue = iter(range(num_requests))

    async def worker() -> None:
        for _ in queue:
            await one_request(transport, key_id, key_hash)

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    num_calls = 2 * num_requests
    return (time.perf_counter() - wall) * 1e6 / num_calls, (time.process_time() - cpu) * 1e6 / num_calls


async def main(num_requests: int, num_rounds: int, concurrencies: list[int]) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        server = EmbeddedRedis(Path(data_dir))
        url = server.start()
        clients: list[Redis] = []
        try:
            redis = connect(url)
            clients.append(redis)
            await scripts.register_all(redis)
            record, secret = await KeyStore(redis).create(LIMITS)
            key_id, key_hash = record.id, hash_key(secret)
            pool_client = connect(url)
            clients.append(pool_client)
            transports: dict[str, Transport] = {
                "pipe": CommandPipe(redis),
                "pipe, private writer": PrivateWriterPipe(redis),
                "pipe, send under socket timeout": SocketTimeoutSendPipe(redis),
                "redis-py evalsha": pool_client,
            }
            names = list(transports)
            for concurrency in concurrencies:
                for name in names:  # warm-up: connections open, code paths hot
                    await timed(transports[name], key_id, key_hash, 200, concurrency)
                walls: dict[str, list[float]] = {name: [] for name in names}
                cpus: dict[str, list[float]] = {name: [] for name in names}
                for round_index in range(num_rounds):
                    order = names[round_index % len(names) :] + names[: round_index % len(names)]
                    for name in order:
                        wall_us, cpu_us = await timed(transports[name], key_id, key_hash, num_requests, concurrency)
                        walls[name].append(wall_us)
                        cpus[name].append(cpu_us)
                report(concurrency, num_requests, num_rounds, walls, cpus)
            for transport in transports.values():
                if isinstance(transport, CommandPipe):
                    await transport.aclose()
        finally:
            for client in clients:
                await client.aclose()
            server.stop()


def report(
    concurrency: int, num_requests: int, num_rounds: int, walls: dict[str, list[float]], cpus: dict[str, list[float]]
) -> None:
    wall = {name: statistics.median(values) for name, values in walls.items()}
    cpu = {name: statistics.median(values) for name, values in cpus.items()}
    cpu_min = {name: min(values) for name, values in cpus.items()}
    print(f"\nconcurrency {concurrency}: {num_requests} requests (2 script calls each) x {num_rounds} rounds")
    print("| transport | wall µs/call, median | ratio | CPU µs/call, median | ratio | CPU µs/call, min | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in wall:
        print(
            f"| {name} | {wall[name]:.1f} | {wall[name] / wall['pipe']:.2f} | {cpu[name]:.1f} | "
            f"{cpu[name] / cpu['pipe']:.2f} | {cpu_min[name]:.1f} | {cpu_min[name] / cpu_min['pipe']:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds, args.concurrency))
