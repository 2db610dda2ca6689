"""Cost of access control per request: `admit` + `settle` against the embedded Redis.

    .venv/bin/python benchmarks/access_overhead.py [--requests 5000] [--concurrency 32]

Prints admits/s and p50/p99 latency of admit and of admit+settle, sequentially and under concurrency, for a key
with RPM/TPM/concurrency limits (every check active) and for the master key (no Redis at all).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from auth.access import AccessConfig, RedisAccess
from auth.base import SettleUsage
from auth.embedded_redis import EmbeddedRedis
from auth.redis_client import connect
from auth.store import KeyStore

MASTER_KEY = "sk-ug-bench-master"


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def _one(access: RedisAccess, secret: str, admit_ms: list[float], total_ms: list[float]) -> None:
    started = time.perf_counter()
    admission = await access.admit(secret, model="bench-model", estimated_tokens=300)
    admitted = time.perf_counter()
    await access.settle(admission, SettleUsage(prompt_tokens=100, completion_tokens=50))
    admit_ms.append((admitted - started) * 1000)
    total_ms.append((time.perf_counter() - started) * 1000)


async def _run(access: RedisAccess, secret: str, num_requests: int, concurrency: int, label: str) -> None:
    admit_ms: list[float] = []
    total_ms: list[float] = []
    semaphore = asyncio.Semaphore(concurrency)

    async def guarded() -> None:
        async with semaphore:
            await _one(access, secret, admit_ms, total_ms)

    started = time.perf_counter()
    await asyncio.gather(*(guarded() for _ in range(num_requests)))
    elapsed = time.perf_counter() - started
    print(
        f"{label:<34} concurrency={concurrency:<3} {num_requests / elapsed:>9.0f} req/s   "
        f"admit p50={_percentile(admit_ms, 50):.3f} ms p99={_percentile(admit_ms, 99):.3f} ms   "
        f"admit+settle p50={_percentile(total_ms, 50):.3f} ms p99={_percentile(total_ms, 99):.3f} ms"
    )


async def main(num_requests: int, concurrency: int) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        server = EmbeddedRedis(Path(data_dir))
        url = server.start()
        try:
            redis = connect(url)
            access = RedisAccess(redis, config=AccessConfig(), master_key=MASTER_KEY)
            await access.start()
            limits = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6, "token_budget": 10**15}
            _, secret = await KeyStore(redis).create(limits)
            await _run(access, secret, 200, 1, "warm-up")
            await _run(access, secret, num_requests, 1, "key with all limits")
            await _run(access, secret, num_requests, concurrency, "key with all limits")
            await _run(access, MASTER_KEY, num_requests, concurrency, "master key (usage recorded only)")
            await access.aclose()
            await redis.aclose()
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.concurrency))
