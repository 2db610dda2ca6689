"""What the request log and tracing cost the gateway, in CPU instructions a request: a count that a shared host's
speed swings do not move.

    .venv/bin/python benchmarks/observability_instructions.py [--requests 500,2500] [--concurrency 32]
                                                              [--configs baseline,request log,...] [--no-valgrind]

On the 2-core VM the req/s of the very same gateway swung ±25% from one second to the next, so the cost of the
request log (a few percent) could be read anywhere from 0.9 to 1.1 by `observability_cost.py`. Here each of the
four gateways of `observability_cost.py` (its `CONFIGS`: the same processes, settings and OTLP receiver) runs under
valgrind's cachegrind (`--cache-sim=no`: instructions only), is sent exactly N non-streaming chat requests (c
clients, master key, the fast fake upstream) after a warm-up, and is stopped; valgrind counts every instruction the
gateway's process ran. Two runs per configuration, N = the two `--requests` figures, so start-up and shutdown cancel:
instructions a request = (I(N2) - I(N1)) / (N2 - N1). Only the gateway's own process is counted: its embedded
Redis, the span sender process and the receiver are not (the gateway's event loop is what serves requests).

The table gives instructions a request, and the baseline's count divided by each configuration's: the share of
requests/s it keeps where the gateway's CPU is what limits it (the issue's targets at c=32: the request log ≥ 0.95
of the baseline; tracing at 100% ≥ 0.85 and at 1% ≥ 0.97 of the request log's gateway, "vs log").

Without valgrind (`--no-valgrind`, or none installed) the runs count the process's CPU time instead (microseconds,
as noisy as the host); the smoke test uses that.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_overhead import BODY, MASTER_KEY, ROOT, free_port, gateway_env, process_cpu_s, wait_for_port
from observability_cost import CONFIGS, Receiver

_VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
_REFS = re.compile(rb"I\s+refs:\s+([\d,]+)")
_WARM_UP = 200  # requests before the counted ones (connections opened, caches and batches warm)


async def send(url: str, num_requests: int, concurrency: int) -> None:
    """Exactly `num_requests` requests, `concurrency` at a time (closed loop); any failure stops the run."""
    headers = {"authorization": f"Bearer {MASTER_KEY}", "content-type": "application/json"}
    left = num_requests
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with session.post(url, data=BODY) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")

        await asyncio.gather(*(client() for _ in range(concurrency)))


def count(
    tmp: Path, name: str, num_requests: int, *, upstream_port: int, receiver_port: int, concurrency: int, valgrind: bool
) -> float:
    """One gateway of configuration `name` sent `_WARM_UP + num_requests` requests: the instructions its process
    ran (valgrind), or its CPU seconds."""
    directory = tmp / f"{name.replace(' ', '_').replace('%', 'pct').replace('+', '')}-{num_requests}"
    directory.mkdir()
    port = free_port()
    extra = CONFIGS[name]
    if "OTEL_TRACES_SAMPLER" in extra:
        extra = {**extra, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**gateway_env(directory, upstream_port, port, base), **extra}
    code = "from gateway.server import run; from gateway.settings import Settings; run(Settings(_env_file=None))"
    command = [*(_VALGRIND if valgrind else []), sys.executable, "-c", code]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_for_port(port, timeout_s=300)  # valgrind starts Python ~15x slower
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        uvloop.run(send(url, _WARM_UP, concurrency))
        cpu_before = process_cpu_s(process.pid)
        uvloop.run(send(url, num_requests, concurrency))
        cpu_after = process_cpu_s(process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    if not valgrind:
        assert cpu_before is not None and cpu_after is not None, "no /proc: CPU time is unknown"
        return cpu_after - cpu_before
    match = _REFS.search(err)
    if match is None:
        raise RuntimeError(f"no instruction count from valgrind: {err[-2000:].decode(errors='replace')}")
    return float(match.group(1).replace(b",", b""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="500,2500", help="the two request counts, N1,N2")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    parser.add_argument("--no-valgrind", action="store_true", help="count CPU time instead of instructions")
    parser.add_argument("--parallel", type=int, default=2, help="gateways measured at once (valgrind is one core)")
    args = parser.parse_args()
    small, large = (int(n) for n in args.requests.split(","))
    names = [name.strip() for name in args.configs.split(",")]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown or "baseline" not in names or large <= small:
        parser.error(f"configs must include baseline and come from {list(CONFIGS)}; N2 > N1 (unknown: {unknown})")
    valgrind = not args.no_valgrind and shutil.which("valgrind") is not None
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        receiver = Receiver()
        upstream_port = free_port()
        upstream = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/upstream.py"), "--port", str(upstream_port), "--uvloop"],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_for_port(upstream_port)
            wait_for_port(receiver.port)
            runs = [(name, n) for name in names for n in (small, large)]
            with ThreadPoolExecutor(max_workers=args.parallel) as pool:
                counted = list(
                    pool.map(
                        lambda run: count(
                            tmp,
                            run[0],
                            run[1],
                            upstream_port=upstream_port,
                            receiver_port=receiver.port,
                            concurrency=args.concurrency,
                            valgrind=valgrind,
                        ),
                        runs,
                    )
                )
        finally:
            upstream.send_signal(signal.SIGINT)
            upstream.wait(15)
            receiver.stop()
    totals = dict(zip(runs, counted, strict=True))
    per_request = {name: (totals[name, large] - totals[name, small]) / (large - small) for name in names}
    unit = "instructions/req" if valgrind else "cpu us/req"
    scale = 1.0 if valgrind else 1e6
    print(
        f"non-streaming chat, c={args.concurrency}, counted over requests {small}..{large} of one gateway process "
        f"({'valgrind cachegrind' if valgrind else 'process CPU time, noisy'})"
    )
    print(f"{'gateway':<12} {unit:>17} {'kept':>6} {'vs log':>6}")
    base = per_request["baseline"]
    logged = per_request.get("request log")

    def share(numerator: float, cost: float) -> float:
        return numerator / cost if cost > 0 else float("nan")  # CPU time counts in clock ticks: 0 for a tiny run

    for name in names:
        cost = per_request[name]
        vs_log = f"{share(logged, cost):>6.3f}" if logged is not None and name.startswith("log +") else f"{'':>6}"
        print(f"{name:<12} {cost * scale:>17,.0f} {share(base, cost):>6.3f} {vs_log}")
    print(f"OTLP receiver: {receiver.num_exports} exports, {receiver.num_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
