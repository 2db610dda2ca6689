"""Cost of the upstream `max_in_flight` slot: a free slot taken and given back, and the hand-off to the next
waiter in fair order while a crowd waits, against the embedded Redis through the real `RedisUpstreamLimiter`.

    .venv/bin/python benchmarks/upstream_handoff.py [--pairs 3000] [--handoffs 3000] [--waiters 200]

Prints, for each case, operations per second on the client and the server's own time per script call (INFO
commandstats: EVALSHA usec_per_call, which includes the commands the script runs):
- free slot: acquire + release with nobody waiting (the path every capped request takes when there is room);
- hand-off: `--waiters` waiters on a `max_in_flight: 1` deployment, each taking the slot, giving it back at once
  and queueing again, so every release hands the slot over (release script, the waiter's wake-up, its confirming
  acquire); spread over 1, 20 and 200 tenants (one FIFO line, or a fair choice among many lines).
Run it on an earlier checkout as well to compare (the limiter's API is the same; earlier ones ignore `tenant`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from auth.access import AccessConfig, RedisAccess
from auth.embedded_redis import EmbeddedRedis
from auth.redis_client import RedisClient, connect

MASTER_KEY = "sk-ug-bench-master"
DEPLOYMENT = "bench"


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def _server_usec_per_call(redis: RedisClient) -> float:
    stats = await redis.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {})
    return float(evalsha.get("usec_per_call", 0.0))


async def _free_slot(access: RedisAccess, redis: RedisClient, num_pairs: int) -> None:
    limiter = access.upstream_limiter
    await redis.config_resetstat()
    latencies_ms = []
    started = time.perf_counter()
    for i in range(num_pairs):
        began = time.perf_counter()
        lease = await limiter.acquire_upstream(DEPLOYMENT, max_in_flight=64, timeout_s=5, tenant=f"t{i % 20}")
        await limiter.release_upstream(lease)
        latencies_ms.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - started
    print(
        f"free slot (nobody waits)           {num_pairs / elapsed:>8.0f} acquire+release/s   "
        f"p50={_percentile(latencies_ms, 50):.3f} ms p99={_percentile(latencies_ms, 99):.3f} ms   "
        f"server {await _server_usec_per_call(redis):.1f} us/script"
    )


async def _hand_offs(
    access: RedisAccess, redis: RedisClient, num_handoffs: int, num_waiters: int, num_tenants: int
) -> None:
    limiter = access.upstream_limiter
    num_left = num_handoffs
    done = asyncio.Event()

    async def waiter(index: int) -> None:
        nonlocal num_left
        tenant = f"t{index % num_tenants}"
        while num_left > 0:
            lease = await limiter.acquire_upstream(DEPLOYMENT, max_in_flight=1, timeout_s=60, tenant=tenant)
            num_left -= 1
            await limiter.release_upstream(lease)
        done.set()

    holder = await limiter.acquire_upstream(DEPLOYMENT, max_in_flight=1, timeout_s=5, tenant="holder")
    tasks = [asyncio.create_task(waiter(i)) for i in range(num_waiters)]
    await asyncio.sleep(1.0)  # every waiter queued behind the holder
    await redis.config_resetstat()
    started = time.perf_counter()
    await limiter.release_upstream(holder)
    await done.wait()
    elapsed = time.perf_counter() - started
    usec = await _server_usec_per_call(redis)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(
        f"hand-off, {num_waiters} waiting, {num_tenants:>3} tenant(s)   {num_handoffs / elapsed:>8.0f} hand-offs/s"
        f"        {elapsed / num_handoffs * 1000:.3f} ms each           server {usec:.1f} us/script"
    )


async def main(num_pairs: int, num_handoffs: int, num_waiters: int) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        server = EmbeddedRedis(Path(data_dir))
        url = server.start()
        try:
            redis = connect(url)
            access = RedisAccess(connect(url), config=AccessConfig(), master_key=MASTER_KEY)
            await access.start()
            await _free_slot(access, redis, 300)  # warm-up
            await _free_slot(access, redis, num_pairs)
            for num_tenants in (1, 20, 200):
                await _hand_offs(access, redis, num_handoffs, num_waiters, num_tenants)
            await access.aclose()
            await redis.aclose()
        finally:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--handoffs", type=int, default=3000)
    parser.add_argument("--waiters", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.pairs, args.handoffs, args.waiters))
