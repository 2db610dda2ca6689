"""How much load the bench client alone can drive: requests/s and streamed tokens/s against a trivial server.

The fake OpenAI-compatible server (tests/bench/bench_fakes.py, zero injected latency) runs in its own process; the bench
client runs here, in one asyncio process, exactly as `unigate bench` runs it. Both processes' CPU use is printed:
the side at ~100% of a core is the limit. If the client is, `unigate bench` figures above that rate measure the
client, not the server (the bench prints a warning when it sees its own CPU saturated).

    .venv/bin/python benchmarks/bench_client_capacity.py [--seconds 5] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.client import BenchClient
from bench.loadgen import LevelSpec, run_level
from bench.stats import level_figures
from bench.workload import parse_length_dist, synthetic_workload

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    """utime + stime of another process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # clock ticks; 100 Hz on Linux


async def _wait_ready(base_url: str) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(200):
            try:
                if (await http.get(f"{base_url}/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("the fake server did not start")


async def _measure(base_url: str, server_pid: int, concurrency: int, output_len: int, seconds: float) -> None:
    workload = synthetic_workload(parse_length_dist("32"), parse_length_dist(str(output_len)))
    spec = LevelSpec(concurrency=concurrency, warmup_s=1.0, duration_s=seconds)
    async with BenchClient(base_url, "", "fake-model", max_connections=concurrency) as client:
        server_cpu, wall = _cpu_seconds(server_pid), time.perf_counter()
        run = await run_level(client, iter(workload), spec)
        server_util = (_cpu_seconds(server_pid) - server_cpu) / (time.perf_counter() - wall)
    figures = level_figures(run, [])
    print(
        f"output_len {output_len:4d}  concurrency {concurrency:4d}: "
        f"{figures['request_throughput']:8.1f} req/s  {figures['output_throughput']:9.1f} streamed tokens/s  "
        f"errors {sum(figures['errors'].values())}  E2E p50 {figures['e2e_ms']['p50']:.1f} ms  "
        f"client CPU {run.cpu_utilization:4.0%}  server CPU {server_util:4.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/bench/bench_fakes.py"), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        asyncio.run(_wait_ready(base_url))
        for output_len in (1, 64, 256):
            asyncio.run(_measure(base_url, server.pid, args.concurrency, output_len, args.seconds))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
