"""Load generation for one level: closed loop (fixed concurrency) or open loop (Poisson arrivals at a rate).

Closed loop: N workers, each sends its next request as soon as the previous one finishes.
Open loop: requests start at exponentially distributed intervals whatever the server is doing, so a slow server
shows up as growing latency instead of silently lowering the offered load (no coordinated omission).

Both: requests *started* during the warm-up are sent but not measured; measuring stops starting requests after
`duration_s` or `max_requests`, whichever comes first, then waits for those in flight (bounded by the HTTP timeout).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from bench.client import BenchClient, RequestResult
from bench.workload import BenchRequest

__all__ = ["LevelRun", "LevelSpec", "run_level"]


@dataclass(frozen=True, slots=True)
class LevelSpec:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests/s
    warmup_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_in_flight: int = 1024  # open loop: arrivals beyond this many in flight are dropped and counted
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a level has either a concurrency or a rate")
        if self.duration_s is None and self.max_requests is None:
            raise ValueError("a level needs a duration or a request count, so it always ends")

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency is not None else f"rate {self.rate:g}/s"


@dataclass(slots=True)
class LevelRun:
    spec: LevelSpec
    results: list[RequestResult] = field(default_factory=list)  # measured requests only
    num_warmup: int = 0
    num_dropped: int = 0
    wall_s: float = 0.0  # from the start of measuring to the last measured request's end
    cpu_utilization: float = 0.0  # this process's CPU time / wall time over the whole level
    max_schedule_lag_s: float = 0.0  # open loop: how late the client started a request (client saturation)


def _ends(spec: LevelSpec, start: float) -> tuple[float, float]:
    warmup_end = start + spec.warmup_s
    deadline = warmup_end + spec.duration_s if spec.duration_s is not None else math.inf
    return warmup_end, deadline


async def run_level(
    client: BenchClient,
    requests: Iterator[BenchRequest],
    spec: LevelSpec,
    on_result: Callable[[RequestResult], None] | None = None,
) -> LevelRun:
    run = LevelRun(spec)
    cpu_start, start = time.process_time(), time.perf_counter()
    if spec.concurrency is not None:
        await _closed_loop(client, requests, spec, run, start, on_result)
    else:
        await _open_loop(client, requests, spec, run, start, on_result)
    end = time.perf_counter()
    run.cpu_utilization = (time.process_time() - cpu_start) / max(end - start, 1e-9)
    if run.results:
        first = min(r.started_at for r in run.results)
        run.wall_s = max(r.started_at + r.e2e_s for r in run.results) - first
    return run


async def _closed_loop(
    client: BenchClient,
    requests: Iterator[BenchRequest],
    spec: LevelSpec,
    run: LevelRun,
    start: float,
    on_result: Callable[[RequestResult], None] | None,
) -> None:
    warmup_end, deadline = _ends(spec, start)
    num_started = 0

    async def worker() -> None:
        nonlocal num_started
        while True:
            now = time.perf_counter()
            is_measured = now >= warmup_end
            if now >= deadline or (is_measured and spec.max_requests is not None and num_started >= spec.max_requests):
                return
            num_started += int(is_measured)
            result = await client.send(next(requests))
            if not is_measured:
                run.num_warmup += 1
                continue
            run.results.append(result)
            if on_result is not None:
                on_result(result)

    assert spec.concurrency is not None
    await asyncio.gather(*(worker() for _ in range(spec.concurrency)))


async def _open_loop(
    client: BenchClient,
    requests: Iterator[BenchRequest],
    spec: LevelSpec,
    run: LevelRun,
    start: float,
    on_result: Callable[[RequestResult], None] | None,
) -> None:
    assert spec.rate is not None
    warmup_end, deadline = _ends(spec, start)
    rng = random.Random(spec.seed)
    in_flight: set[asyncio.Task[None]] = set()
    num_started = 0
    next_at = start

    async def one(request: BenchRequest, is_measured: bool) -> None:
        result = await client.send(request)
        if not is_measured:
            run.num_warmup += 1
            return
        run.results.append(result)
        if on_result is not None:
            on_result(result)

    while True:
        next_at += rng.expovariate(spec.rate)
        is_measured = next_at >= warmup_end
        if next_at >= deadline or (is_measured and spec.max_requests is not None and num_started >= spec.max_requests):
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        run.max_schedule_lag_s = max(run.max_schedule_lag_s, time.perf_counter() - next_at)
        if len(in_flight) >= spec.max_in_flight:
            run.num_dropped += int(is_measured)
            continue
        num_started += int(is_measured)
        task = asyncio.create_task(one(next(requests), is_measured))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)
