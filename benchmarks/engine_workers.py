"""One engine per host: memory and throughput of `unigate serve --workers N` with a local model, for each N.

    .venv/bin/python benchmarks/engine_workers.py [--workers 1,4] [--requests 48] [--concurrency 8] [--model PATH]
        [--code old=/tmp/old,new=. --rounds 3]

For each N: starts `unigate serve --workers N` (no routing file: the bundled model, or `--model`) on a free port
with a temporary data directory, waits until /health/ready says the model is up, sends 4·N concurrent warm-up
requests on fresh connections (so every worker has served), then reads the memory of the whole process tree
(parent, workers, engine process, embedded Redis: RSS, and PSS, which counts shared pages once) and runs
`unigate bench` at each `--concurrency` level for `--requests` streamed requests (`--input-len`/`--output-len`
tokens). With N = 1 the engine runs inside the one worker; with N > 1 in one engine process the parent starts.

`--code NAME=DIR,...` compares checkouts (e.g. a `git worktree` of an older commit) on the same host: each round
serves every N from each checkout in turn (`PYTHONPATH=DIR`, this virtual environment), `--rounds` times; the
client (`unigate bench`) is always this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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


def measure(num_workers: int, args: argparse.Namespace, code: str = "", code_dir: str = "") -> dict[str, Any]:
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
            memory = tree_memory(process.pid)
            out = Path(data_dir) / "bench.json"
            bench = [
                str(UNIGATE), "bench", "--base-url", f"{url}/v1", "--api-key", MASTER_KEY, "--model", "local",
                "--concurrency", str(args.concurrency), "--warmup", "0", "--requests", str(args.requests),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--no-telemetry",
                "--out", str(out),
            ]  # fmt: skip
            client_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            subprocess.run(bench, check=True, capture_output=True, env=client_env)
            levels = json.loads(out.read_text())["levels"]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    return {"code": code, "workers": num_workers, "ready_s": ready_s, "memory": memory, "levels": levels}


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
    print("| code | workers | c | requests | errors | output tok/s | req/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        for level in result["levels"]:
            print(
                f"| {result['code']} | {result['workers']} | {level['concurrency']} | {level['requests']} | "
                f"{sum(level['errors'].values())} | {level['output_throughput']:.1f} | "
                f"{level['request_throughput']:.2f} | {level['ttft_ms']['p50']:.0f} | {level['ttft_ms']['p95']:.0f} | "
                f"{level['tpot_ms']['p50']:.1f} |"
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
    codes = [tuple(item.split("=", 1)) for item in args.code.split(",") if item] or [("this", "")]
    results = []
    for _ in range(args.rounds):
        for name, directory in codes:
            for n in args.workers.split(","):
                results.append(measure(int(n), args, name, directory))
                report(results[-1:])  # as it goes: a long comparison shows progress
    print("\nall runs, in order:\n")
    report(results)


if __name__ == "__main__":
    main()
