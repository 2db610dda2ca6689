"""Gateway overhead: the same load against a fast fake upstream directly and through one gateway worker.

    .venv/bin/python benchmarks/gateway_overhead.py [--seconds 5] [--concurrency 1,32,128] [--limits [--team]]
        [--rounds 1] [--modes non-stream,stream]

Three processes: the fake upstream (tests/fakes/upstream.py, uvloop), the gateway (`gateway.server.run`, one
uvicorn worker, uvloop + httptools), and this load generator (aiohttp, uvloop, closed loop: `c` clients each
sending the next request when the previous one finished). Prints requests/s and p50/p99 latency per concurrency
for non-streaming calls, p50/p99 time to first token for streaming calls, the overhead (gateway - direct), and
the gateway process's CPU time per request (Linux): on a box shared with other work the latencies swing from run
to run, the CPU cost per request much less, so compare that one between versions. `tail` is p99 / p50, taken in
each round and the median over the rounds printed: pooled over rounds taken under different background load, the
slow rounds' latencies would make a p99 that no one round had. Before the clock starts, each measurement opens all
`c` connections (one request each at once), so no percentile holds a connection's first request.

The gateway's embedded Redis lives in a temporary data directory, so runs never load (or grow) a real one.

`--rounds N` splits each measurement into N parts of `--seconds / N`, taken in turn (direct, gateway, gateway with
limits, then again): on a box whose other load changes from second to second, the ratio of two rows then compares
like with like. Each row sums its rounds (requests, time, CPU; latencies pooled).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parent.parent
MASTER_KEY = "sk-bench-master-key-0123456789abcdef"  # 32+ characters: `serve` refuses shorter ones
BODY = b'{"model": "bench", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}'
STREAM_BODY = BODY[:-1] + b', "stream": true}'


@dataclass
class Result:
    num_requests: int
    seconds: float
    latencies_ms: list[float]
    num_errors: int
    cpu_s: float | None = None  # CPU time the measured server process used during the run (None: unknown)
    tails: list[float] = field(default_factory=list)  # p99 / p50 of each round

    def __post_init__(self) -> None:
        if not self.tails and self.latencies_ms:
            self.tails = [self.percentile(0.99) / self.percentile(0.5)]

    def plus(self, other: Result) -> Result:
        """Two measurements of the same thing taken apart, as one."""
        cpu_s = None if self.cpu_s is None or other.cpu_s is None else self.cpu_s + other.cpu_s
        return Result(
            self.num_requests + other.num_requests,
            self.seconds + other.seconds,
            self.latencies_ms + other.latencies_ms,
            self.num_errors + other.num_errors,
            cpu_s,
            self.tails + other.tails,
        )

    @property
    def tail(self) -> float:
        """p99 / p50, the median over the rounds (each round's own ratio: see the module docstring)."""
        return statistics.median(self.tails) if self.tails else float("nan")

    @property
    def cpu_us_per_request(self) -> float:
        if self.cpu_s is None or not self.num_requests:
            return float("nan")
        return self.cpu_s / self.num_requests * 1e6

    @property
    def rps(self) -> float:
        return self.num_requests / self.seconds

    def percentile(self, q: float) -> float:
        values = sorted(self.latencies_ms)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc), None elsewhere."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on port {port}")


async def one_request(session: aiohttp.ClientSession, url: str, *, stream: bool) -> float:
    """Latency in ms: the whole response, or (streaming) the first data line."""
    started = time.perf_counter()
    async with session.post(url, data=STREAM_BODY if stream else BODY) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        if not stream:
            await response.read()
            return (time.perf_counter() - started) * 1000
        first: float | None = None
        async for line in response.content:
            if first is None and line.startswith(b"data:"):
                first = (time.perf_counter() - started) * 1000
        assert first is not None
        return first


async def load(
    url: str,
    *,
    concurrency: int,
    seconds: float,
    stream: bool,
    api_key: str = MASTER_KEY,
    server_pid: int | None = None,
) -> Result:
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    num_errors = 0
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        # Warm-up: every client's connection opened (their first requests at once, as the run will send them),
        # caches filled; a connection's first request (accept, a new upstream connection) is not measured.
        for _ in range(2):
            await asyncio.gather(*(one_request(session, url, stream=stream) for _ in range(concurrency)))
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal num_errors
            while time.perf_counter() < deadline:
                try:
                    latencies.append(await one_request(session, url, stream=stream))
                except Exception:
                    num_errors += 1

        started = time.perf_counter()
        cpu_before = process_cpu_s(server_pid)
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu_after = process_cpu_s(server_pid)
    cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return Result(len(latencies), elapsed, latencies, num_errors, cpu_s)


def gateway_env(directory: Path, upstream_port: int, gateway_port: int, base: dict[str, str]) -> dict[str, str]:
    """The environment of a benchmarked gateway (`base` plus its settings): one model, `bench`, on the fake
    upstream at `upstream_port`, served on `gateway_port`, its data (and embedded Redis) under `directory`."""
    routing = directory / "unigate.yaml"
    routing.write_text(
        "models:\n  - id: bench\n    deployments:\n"
        f"      - {{type: openai, base_url: 'http://127.0.0.1:{upstream_port}/v1', api_key: sk-up,"
        " max_connections: 256}\n"
    )
    return {
        **base,
        "UNIGATE_CONFIG": str(routing),
        "UNIGATE_MASTER_KEY": MASTER_KEY,
        "UNIGATE_PORT": str(gateway_port),
        "UNIGATE_ENGINE__ENABLED": "false",
        "UNIGATE_DATA_DIR": str(directory / "data"),
        "UNIGATE_LOG_LEVEL": os.environ.get("UNIGATE_LOG_LEVEL", "warning"),
    }


def start_processes(tmp: Path) -> tuple[list[subprocess.Popen[bytes]], str, str]:
    upstream_port, gateway_port = free_port(), free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/fakes/upstream.py"), "--port", str(upstream_port), "--uvloop"],
        stdout=subprocess.DEVNULL,
    )
    env = gateway_env(tmp, upstream_port, gateway_port, dict(os.environ))
    code = "from gateway.server import run; from gateway.settings import Settings; run(Settings(_env_file=None))"
    gateway = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT)
    wait_for_port(upstream_port)
    wait_for_port(gateway_port)
    return (
        [upstream, gateway],
        f"http://127.0.0.1:{upstream_port}/v1/chat/completions",
        f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,32,128")
    parser.add_argument(
        "--rounds", type=int, default=1, help="take each measurement in this many parts, in turn (see the docstring)"
    )
    parser.add_argument(
        "--modes",
        default="non-stream,stream",
        help="which calls to measure: non-stream, stream or both (comma-separated)",
    )
    parser.add_argument("--hold", action="store_true", help="only start the processes and wait (for profiling)")
    parser.add_argument(
        "--limits",
        action="store_true",
        help="also measure with a unified key that has RPM/TPM/concurrency limits (auth + Redis limits on)",
    )
    parser.add_argument(
        "--team",
        action="store_true",
        help="with --limits: the limited key is in a team with the same limits (the key's and the team's admissions)",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [mode.strip() for mode in args.modes.split(",")]
    if not modes or not set(modes) <= {"non-stream", "stream"}:
        parser.error("--modes takes non-stream, stream or both")
    with tempfile.TemporaryDirectory() as tmp:
        processes, direct_url, gateway_url = start_processes(Path(tmp))
        try:
            if args.hold:
                print(f"direct: {direct_url}\ngateway: {gateway_url}\n(ctrl-c to stop)", flush=True)
                signal.pause()
            limited_key = create_limited_key(gateway_url, in_team=args.team) if args.limits else None
            rows = uvloop.run(
                run_all(
                    levels,
                    args.seconds,
                    direct_url,
                    gateway_url,
                    limited_key,
                    gateway_pid=processes[1].pid,
                    num_rounds=max(1, args.rounds),
                    streams=[mode == "stream" for mode in modes],
                )
            )
        finally:
            for process in processes:
                process.send_signal(signal.SIGINT)
            for process in processes:
                process.wait(10)
    print_table(rows)


def create_limited_key(gateway_url: str, *, in_team: bool = False) -> str:
    """A unified key whose limits are never reached, so every request runs the full admit/settle Lua path (with
    `in_team`, twice: the key's and its team's, which has the same limits)."""
    import httpx

    admin = gateway_url.replace("/v1/chat/completions", "/admin/keys")
    headers = {"authorization": f"Bearer {MASTER_KEY}"}
    body: dict[str, object] = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 100_000, "token_budget": 10**15}
    if in_team:
        team = httpx.post(admin.replace("/keys", "/teams"), json={"name": "bench", **body}, headers=headers)
        team.raise_for_status()
        body["team_id"] = team.json()["id"]
    response = httpx.post(admin, json={"name": "bench", **body}, headers=headers)
    response.raise_for_status()
    return str(response.json()["key"])


async def run_all(
    levels: list[int],
    seconds: float,
    direct_url: str,
    gateway_url: str,
    limited_key: str | None,
    *,
    gateway_pid: int | None = None,
    num_rounds: int = 1,
    streams: list[bool] | None = None,
) -> list[tuple[str, int, Result, Result]]:
    rows = []
    part_s = seconds / num_rounds
    for stream in streams if streams is not None else [False, True]:
        mode = "stream TTFT" if stream else "non-stream"
        for concurrency in levels:
            direct: Result | None = None
            through: Result | None = None
            limited: Result | None = None
            for _ in range(num_rounds):
                one = await load(direct_url, concurrency=concurrency, seconds=part_s, stream=stream)
                direct = one if direct is None else direct.plus(one)
                one = await load(
                    gateway_url, concurrency=concurrency, seconds=part_s, stream=stream, server_pid=gateway_pid
                )
                through = one if through is None else through.plus(one)
                if limited_key is not None:
                    one = await load(
                        gateway_url,
                        concurrency=concurrency,
                        seconds=part_s,
                        stream=stream,
                        api_key=limited_key,
                        server_pid=gateway_pid,
                    )
                    limited = one if limited is None else limited.plus(one)
            assert direct is not None and through is not None
            rows.append((mode, concurrency, direct, through))
            if limited is not None:
                rows.append((f"{mode}+limits", concurrency, direct, limited))
    return rows


def print_table(rows: list[tuple[str, int, Result, Result]]) -> None:
    header = (
        f"{'mode':<18} {'c':>4} | {'direct req/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'tail':>5} | "
        f"{'gateway req/s':>13} {'p50 ms':>8} {'p99 ms':>8} {'tail':>5} | {'added p50 ms':>12} {'added p99 ms':>12} "
        f"{'gw cpu us/req':>13} {'errors':>6}"
    )
    print(header)
    print("-" * len(header))
    for mode, concurrency, direct, through in rows:
        print(
            f"{mode:<18} {concurrency:>4} | {direct.rps:>12.0f} {direct.percentile(0.5):>8.2f} "
            f"{direct.percentile(0.99):>8.2f} {direct.tail:>5.2f} | {through.rps:>13.0f} "
            f"{through.percentile(0.5):>8.2f} {through.percentile(0.99):>8.2f} {through.tail:>5.2f} | "
            f"{through.percentile(0.5) - direct.percentile(0.5):>12.2f} "
            f"{through.percentile(0.99) - direct.percentile(0.99):>12.2f} {through.cpu_us_per_request:>13.0f} "
            f"{direct.num_errors + through.num_errors:>6}"
        )


if __name__ == "__main__":
    main()
