"""Where one gateway worker's latency tail comes from: the fast fake upstream, a closed loop of `c` clients.

    .venv/bin/python benchmarks/gateway_tail.py [--concurrency 128] [--seconds 10] [--gc-threshold N]

The processes of gateway_overhead.py (fake upstream, `gateway.server.run` with its embedded Redis, an aiohttp load
generator, non-streaming calls), with probes in the gateway process: every cyclic-GC collection (its generation,
the objects it walked, its CPU time) and the event loop's lag (how late a 5 ms timer fires, and how much of that
the loop's thread spent on the CPU: a loop busy with a long batch of callbacks, or a process the host did not run).
It prints the latency percentiles and p99 / p50, the collections, the lags over 50 ms, and whether the slow requests
were slow together (a stall of everything in flight: for each request at or over p99, the median latency of the
requests started within 5 ms of it, as a share of its own) or alone (an unfair order: some requests overtaken).
`--gc-threshold` replaces the gateway's young-generation threshold (`gateway.server`) to compare settings.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import MASTER_KEY, ROOT, free_port, gateway_env, one_request, process_cpu_s, wait_for_port

_PROBES_ENV = "UNIGATE_BENCH_PROBES_OUT"  # where the probed gateway writes what it saw, at exit
_GC_ENV = "UNIGATE_BENCH_GC_THRESHOLD"


def serve_probed() -> None:
    """The gateway as `gateway.server.run` serves it, with the GC and loop probes (runs in the gateway process)."""
    import atexit

    import gateway.server as server
    from gateway.settings import load_settings

    collections: list[tuple[float, int, int, float]] = []  # (end, generation, objects walked, CPU ms)
    lags: list[tuple[float, float, float]] = []  # (end, lag ms, the loop thread's CPU ms over the timer)
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started["cpu"] = time.thread_time()
            started["objects"] = len(gc.get_objects(info["generation"]))
        else:
            cpu_ms = (time.thread_time() - started["cpu"]) * 1000
            collections.append((time.perf_counter(), info["generation"], int(started["objects"]), cpu_ms))

    async def watch_loop() -> None:
        while True:
            wall, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(0.005)
            lag_ms = (time.perf_counter() - wall - 0.005) * 1000
            if lag_ms > 5:
                lags.append((time.perf_counter(), lag_ms, (time.thread_time() - cpu) * 1000))

    build = server.app_from_env

    def app_from_env() -> Any:
        app = build()
        if os.environ.get(_GC_ENV):
            gc.set_threshold(int(os.environ[_GC_ENV]), *gc.get_threshold()[1:])
        watcher: list[asyncio.Task[None]] = []

        async def probed(scope: Any, receive: Any, send: Any) -> None:
            if not watcher:
                watcher.append(asyncio.get_running_loop().create_task(watch_loop()))
            await app(scope, receive, send)

        return probed

    server.app_from_env = app_from_env  # uvicorn imports "gateway.server:app_from_env" after this
    gc.callbacks.append(on_gc)
    out = Path(os.environ[_PROBES_ENV])
    atexit.register(lambda: out.write_text(json.dumps({"collections": collections, "lags": lags})))
    try:
        server.run(load_settings(_env_file=None))
    except KeyboardInterrupt:  # the SIGINT that stops it
        pass


async def closed_loop(url: str, concurrency: int, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """(when the clock started, [(request start, latency ms)]) after every client's connection is open."""
    headers = {"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json"}
    samples: list[tuple[float, float]] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        for _ in range(2):
            await asyncio.gather(*(one_request(session, url, stream=False) for _ in range(concurrency)))
        started = time.perf_counter()
        deadline = started + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                samples.append((start, await one_request(session, url, stream=False)))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return started, samples


def report(started: float, seconds: float, samples: list[tuple[float, float]], probes: dict[str, Any]) -> None:
    latencies = sorted(latency for _, latency in samples)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

    print(
        f"{len(samples)} requests, {len(samples) / seconds:.0f} req/s; latency ms p10 {pct(0.1):.1f}, "
        f"p50 {pct(0.5):.1f}, p90 {pct(0.9):.1f}, p99 {pct(0.99):.1f}, max {latencies[-1]:.1f}; "
        f"p99/p50 {pct(0.99) / pct(0.5):.2f}"
    )
    ended = started + seconds
    collections = [c for c in probes["collections"] if started <= c[0] <= ended]
    for generation in (0, 1, 2):
        mine = [c for c in collections if c[1] == generation]
        if mine:
            print(
                f"GC generation {generation}: {len(mine)} collections, {sum(c[3] for c in mine):.0f} ms CPU "
                f"(longest {max(c[3] for c in mine):.1f}), {statistics.mean(c[2] for c in mine):,.0f} objects walked"
            )
    if not collections:
        print("GC: no collection")
    lags = [lag for lag in probes["lags"] if started <= lag[0] <= ended and lag[1] > 50]
    if lags:
        wall = sum(lag[1] + 5 for lag in lags)
        print(
            f"event loop late by over 50 ms: {len(lags)} times, {sum(lag[1] for lag in lags):.0f} ms in all "
            f"(longest {max(lag[1] for lag in lags):.0f}); the loop ran for {sum(lag[2] for lag in lags) / wall:.0%} "
            "of it (the rest: the process waited for a CPU)"
        )
    by_start = sorted(samples)
    starts = [start for start, _ in by_start]
    shares = []
    for start, latency in by_start:
        if latency >= pct(0.99):
            near = by_start[bisect.bisect_left(starts, start - 0.005) : bisect.bisect_right(starts, start + 0.005)]
            shares.append(statistics.median(other for _, other in near) / latency)
    together = sum(share >= 0.8 for share in shares) / len(shares)
    print(
        f"requests at or over p99: {len(shares)}; {together:.0%} of them were slow together (the requests started "
        "within 5 ms of one took at least 0.8x its time)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gc-threshold", type=int, default=None, help="the gateway's young-generation threshold")
    parser.add_argument("--serve-probed", action="store_true", help=argparse.SUPPRESS)  # the gateway process
    args = parser.parse_args()
    if args.serve_probed:
        serve_probed()
        return
    with tempfile.TemporaryDirectory() as tmp:
        upstream_port, gateway_port = free_port(), free_port()
        env = {
            **gateway_env(Path(tmp), upstream_port, gateway_port, dict(os.environ)),
            _PROBES_ENV: str(Path(tmp) / "probes.json"),
            **({_GC_ENV: str(args.gc_threshold)} if args.gc_threshold else {}),
        }
        upstream = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/upstream.py"), "--port", str(upstream_port), "--uvloop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        gateway = subprocess.Popen([sys.executable, __file__, "--serve-probed"], env=env, cwd=ROOT)
        try:
            wait_for_port(upstream_port)
            wait_for_port(gateway_port)
            url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            cpu_before = process_cpu_s(gateway.pid)
            started, samples = uvloop.run(closed_loop(url, args.concurrency, args.seconds))
            cpu_after = process_cpu_s(gateway.pid)
        finally:
            for process in (gateway, upstream):
                process.send_signal(signal.SIGINT)
                process.wait(20)
        probes = json.loads((Path(tmp) / "probes.json").read_text())
    if cpu_before is not None and cpu_after is not None:
        print(f"c={args.concurrency}: gateway CPU {(cpu_after - cpu_before) / len(samples) * 1e6:.0f} us per request")
    report(started, args.seconds, samples, probes)


if __name__ == "__main__":
    main()
