"""One engine per host: memory and throughput of `unigate serve --workers N` with a local model, for each N.

    .venv/bin/python benchmarks/engine_workers.py [--workers 1,4] [--requests 48] [--concurrency 8] [--model PATH]
        [--code old=/tmp/old,new=. --rounds 3]

For each N: starts `unigate serve --workers N` (no routing file: the bundled model, or `--model`) on a free port
with a temporary data directory, waits until /health/ready says the model is up, sends 4·N concurrent warm-up
requests on fresh connections (so every worker has served), then reads the memory of the whole process tree
(parent, workers, engine process, embedded Redis: RSS, and PSS, which counts shared pages once) and runs
`unigate bench` at each `--concurrency` level for `--requests` streamed requests (`--input-len`/`--output-len`
tokens). With N = 1 the engine runs inside the one worker; with N > 1 in one engine process the parent starts.

`--code NAME=DIR,...` compares checkouts (e.g. a `git worktree` of an older commit) on the same host: for each N
every checkout serves at once (`PYTHONPATH=DIR`, this virtual environment) and `unigate bench` (always this
checkout's client) runs against each in turn, `--rounds` times, the order rotating.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
UNIGATE = Path(sys.executable).with_name("unigate")
MASTER_KEY = "sk-bench-master-key-0123456789abcdef"  # 32+ characters: `serve` refuses shorter ones
MIB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def role(process: psutil.Process, parent: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    if process.pid == parent.pid:
        return "parent"
    if "gateway.engine_host" in command or "gateway.engine_process" in command:  # (the latter: before issue 37)
        return "engine"
    if "redis-server" in command:
        return "redis"
    if "multiprocessing.spawn" in command:
        return "worker"
    return "other"


def tree_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds of the tree's processes so far, by role."""
    parent = psutil.Process(pid)
    by_role: dict[str, float] = {}
    for process in [parent, *parent.children(recursive=True)]:
        times = process.cpu_times()
        by_role[role(process, parent)] = by_role.get(role(process, parent), 0.0) + times.user + times.system
    return by_role


def tree_memory(pid: int) -> dict[str, list[tuple[int, int]]]:
    """(RSS, PSS) bytes of each process of the tree, by role."""
    parent = psutil.Process(pid)
    by_role: dict[str, list[tuple[int, int]]] = {}
    for process in [parent, *parent.children(recursive=True)]:
        info = process.memory_full_info()
        by_role.setdefault(role(process, parent), []).append((info.rss, info.pss))
    return by_role


async def warm_up(url: str, num_requests: int) -> None:
    body = {"model": "local", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4}

    async def one() -> None:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer {MASTER_KEY}"}, timeout=300) as client:
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()

    await asyncio.gather(*(one() for _ in range(num_requests)))


def wait_ready(process: subprocess.Popen[bytes], url: str, timeout_s: float = 600) -> float:
    started = time.monotonic()
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the gateway exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health/ready", timeout=5).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        if time.monotonic() - started > timeout_s:
            raise SystemExit("the gateway did not become ready")
        time.sleep(0.2)


@contextlib.contextmanager
def serving(num_workers: int, args: argparse.Namespace, code_dir: str) -> Iterator[dict[str, Any]]:
    """`unigate serve --workers N` (from `code_dir`, else this checkout), ready and warmed up, until the block ends:
    its URL, time to ready and the memory of its process tree."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="ug-bench-") as data_dir:
        env = {**os.environ, "UNIGATE_MASTER_KEY": MASTER_KEY, "UNIGATE_PORT": str(port)}
        env.update({"UNIGATE_DATA_DIR": data_dir, "UNIGATE_LOG_LEVEL": "warning"})
        if code_dir:
            env["PYTHONPATH"] = str(Path(code_dir).resolve())
        if args.model:
            env["UNIGATE_ENGINE__MODEL_PATH"] = args.model
        process = subprocess.Popen([str(UNIGATE), "serve", "--workers", str(num_workers)], env=env, cwd=data_dir)
        try:
            ready_s = wait_ready(process, url)
            asyncio.run(warm_up(url, 4 * num_workers))
            yield {"url": url, "pid": process.pid, "ready_s": ready_s, "memory": tree_memory(process.pid)}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(120)


def bench(server: dict[str, Any], args: argparse.Namespace, concurrency: int) -> dict[str, Any]:
    """One `unigate bench` run (this checkout's client) at one concurrency level: its level, with the CPU the
    server's processes spent per output token (ms, by role: on a host shared with other jobs, a steadier figure
    of what a request costs than its timings)."""
    before = tree_cpu_s(server["pid"])
    with tempfile.TemporaryDirectory(prefix="ug-bench-out-") as directory:
        out = Path(directory) / "bench.json"
        command = [
            str(UNIGATE), "bench", "--base-url", f"{server['url']}/v1", "--api-key", MASTER_KEY, "--model", "local",
            "--concurrency", str(concurrency), "--warmup", "0", "--requests", str(args.requests),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--no-telemetry",
            "--out", str(out),
        ]  # fmt: skip
        client_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(command, check=True, capture_output=True, env=client_env)
        [level] = json.loads(out.read_text())["levels"]
    after = tree_cpu_s(server["pid"])
    num_tokens = (level["output_tokens_mean"] or 0) * level["successful"] or math.nan
    level["cpu_ms_per_token"] = {name: (after[name] - before.get(name, 0.0)) * 1000 / num_tokens for name in after}
    return dict(level)


def measure(num_workers: int, args: argparse.Namespace, codes: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Every checkout of `codes` serving at once (an idle one costs next to nothing), benched in turn `--rounds`
    times, the order rotating each round: a host whose load swings loads each alike."""
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(serving(num_workers, args, directory)) for name, directory in codes}
        for round_index in range(args.rounds):
            names = list(servers)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                server = servers[name]
                levels = [bench(server, args, int(c)) for c in args.concurrency.split(",")]
                results.append({"code": name, "workers": num_workers, **server, "levels": levels})
                report(results[-1:])  # as it goes: a long comparison shows progress
    return results


def report(results: list[dict[str, Any]]) -> None:
    print("| code | workers | ready s | tree RSS MiB | tree PSS MiB | parent | each worker (RSS) | engine | redis |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        memory = result["memory"]
        rss = sum(r for rows in memory.values() for r, _ in rows) / MIB
        pss = sum(p for rows in memory.values() for _, p in rows) / MIB

        def cell(name: str, memory: dict[str, list[tuple[int, int]]] = memory) -> str:
            return " / ".join(f"{r / MIB:.0f}" for r, _ in memory.get(name, [])) or "-"

        print(
            f"| {result['code']} | {result['workers']} | {result['ready_s']:.1f} | {rss:.0f} | {pss:.0f} | "
            f"{cell('parent')} | {cell('worker')} | {cell('engine')} | {cell('redis')} |"
        )
    print()
    print("| code | workers | c | requests | errors | tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | CPU ms/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for result in results:
        for level in result["levels"]:
            print(
                f"| {result['code']} | {result['workers']} | {level['concurrency']} | {level['requests']} | "
                f"{sum(level['errors'].values())} | {level['output_throughput']:.1f} | "
                f"{level['ttft_ms']['p50']:.0f} | {level['ttft_ms']['p95']:.0f} | {level['tpot_ms']['p50']:.1f} | "
                f"{_cpu_cell(level)} |"
            )


def _cpu_cell(level: dict[str, Any]) -> str:
    cpu = level.get("cpu_ms_per_token", {})
    return ", ".join(f"{name} {cpu[name]:.2f}" for name in ("engine", "worker", "parent") if name in cpu) or "-"


def summarize(results: list[dict[str, Any]]) -> None:
    """Medians over the rounds, per checkout and level."""
    print("| code | workers | c | rounds | output tok/s | TTFT p50 ms | TPOT p50 ms | CPU ms/token |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for result in results:
        for level in result["levels"]:
            groups.setdefault((result["code"], result["workers"], level["concurrency"]), []).append(level)
    for (code, workers, concurrency), levels in groups.items():

        def median(get: Any, levels: list[dict[str, Any]] = levels) -> float:
            return statistics.median(get(level) for level in levels)

        cpu = {
            name: median(lambda level, name=name: level["cpu_ms_per_token"].get(name, math.nan))
            for name in ("engine", "worker")
        }
        print(
            f"| {code} | {workers} | {concurrency} | {len(levels)} | {median(lambda x: x['output_throughput']):.1f} | "
            f"{median(lambda x: x['ttft_ms']['p50']):.0f} | {median(lambda x: x['tpot_ms']['p50']):.1f} | "
            f"engine {cpu['engine']:.2f}, workers {cpu['worker']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", default="8", help="comma-separated concurrency levels")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--model", help="HF directory or .gguf file (default: the bundled model)")
    parser.add_argument("--code", default="", help="NAME=DIR,... checkouts to alternate (default: this one)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    codes = [(name, directory) for name, _, directory in (item.partition("=") for item in args.code.split(",") if item)]
    results = [result for n in args.workers.split(",") for result in measure(int(n), args, codes or [("this", "")])]
    print("\nall runs, in order:\n")
    report(results)
    print()
    summarize(results)


if __name__ == "__main__":
    main()
