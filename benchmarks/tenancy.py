"""The local engine shared by tenants, on the bundled model, through the AsyncEngine directly (the engine's own
scheduling, without the gateway's HTTP in front), fair share against first come, first served, in one run.

    python benchmarks/tenancy.py                                # the issue's workload (several minutes on 2 cores)
    python benchmarks/tenancy.py --quick                        # a smoke run
    python benchmarks/tenancy.py --parts alone --rounds 4       # one part (burst, alone, shares), more rounds

Reported:
- burst: tenant A opens N streams (64 tokens each) at once; after a delay B sends short streaming requests one
  after another: B's worst and p50 TTFT, fair and FCFS; and B's p50 beside as many of A's streams as run at once
  (no queue: what the batch itself costs);
- one tenant alone: output tokens/s, fair vs FCFS (alternating rounds, best of each);
- two saturating tenants, weights 1:1 and 3:1: the ratio of tokens served over a window of steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import Counter

import torch

from local_engine.async_engine import AsyncEngine
from local_engine.block_manager import BlockManager
from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.fair_share import Tenancy
from local_engine.loader import bundled_model_path, load_checkpoint
from local_engine.sampling_params import SamplingParams
from local_engine.scheduler import Scheduler
from local_engine.sequence import Sequence


def prompt(i: int, length: int = 24) -> list[int]:
    return [(i * 131 + j * 7) % 20000 + 100 for j in range(length)]


async def b_ttfts(engine: LLMEngine, num_a: int, a_tokens: int, num_b: int, delay_s: float) -> list[float]:
    """A opens `num_a` streams; after `delay_s` B sends `num_b` short requests one after another: B's TTFTs."""
    runner = AsyncEngine(engine)

    async def consume(tokens: list[int], max_tokens: int, tenancy: Tenancy, rid: str) -> float:
        started = time.perf_counter()
        first = 0.0
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for _ in runner.generate(tokens, params, rid, tenancy=tenancy):
            first = first or time.perf_counter() - started
        return first

    a = [asyncio.create_task(consume(prompt(i), a_tokens, Tenancy("A"), f"a{i}")) for i in range(num_a)]
    await asyncio.sleep(delay_s)
    ttfts = [await consume(prompt(10_000 + i, 12), 8, Tenancy("B"), f"b{i}") for i in range(num_b)]
    await asyncio.gather(*a)
    await runner.shutdown()
    return ttfts


def throughput(engine: LLMEngine, num: int, tokens: int, cpu_rates: list[float] | None = None) -> float:
    """One tenant, `num` requests at once: output tokens/s (and, into `cpu_rates`, output tokens per CPU-second of
    this process, which other work on a shared host moves much less than the wall clock)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"t{i}", prompt(i), params)
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests:
        engine.step()
    if cpu_rates is not None:
        cpu_rates.append(num * tokens / (time.process_time() - cpu_started))
    return num * tokens / (time.perf_counter() - started)


def scheduling_s(num_seqs: int, tokens: int, *, is_fair: bool) -> tuple[float, int]:
    """The scheduler alone (no model: each step "samples" token 7), one tenant, `num_seqs` requests at once: the
    seconds spent in `schedule()` + `postprocess()` and the steps taken."""
    blocks = BlockManager(num_seqs * (24 + tokens) // 16 + num_seqs, 16)
    scheduler = Scheduler(blocks, max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=4096)
    scheduler.is_fair = is_fair
    for i in range(num_seqs):
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        scheduler.add(Sequence(f"s{i}", prompt(i), params, max_tokens=tokens))
    num_steps = 0
    started = time.perf_counter()
    while scheduler.has_unfinished:
        batch = scheduler.schedule()
        scheduler.postprocess(batch, [7] * len(batch.seqs))  # (every prompt fits one step: each one samples)
        num_steps += 1
    return time.perf_counter() - started, num_steps


def served_ratio(engine: LLMEngine, weights: tuple[float, float], num_steps: int) -> tuple[float, float]:
    """Two tenants each far beyond the batch: A's served tokens over B's in `num_steps` steps after a warm-up, and
    the window's seconds."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    # enough for both tenants to stay backlogged through the window (a drained tenant would skew the ratio to 1:1)
    for i in range(engine.scheduler.max_num_seqs * num_steps // 16):
        for tenant, weight in zip("AB", weights, strict=True):
            engine.add_request(f"{tenant}{i}", prompt(i), params, Tenancy(tenant, weight=weight))
    for _ in range(num_steps // 4):
        engine.step()
    before = Counter(engine.scheduler.fair.served_tokens)
    started = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    elapsed = time.perf_counter() - started
    served = Counter(engine.scheduler.fair.served_tokens)
    served.subtract(before)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return served["A"] / served["B"], elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run (smaller burst, fewer steps)")
    parser.add_argument(
        "--parts", default="burst,alone,shares", help="which parts to run, comma-separated (burst, alone, shares)"
    )
    parser.add_argument("--rounds", type=int, help="alternating fair/FCFS rounds of the one-tenant part")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (fewer swing less on a shared host)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    num_a, num_b, delay_s, num_steps, rounds = (60, 4, 0.5, 40, 1) if args.quick else (200, 12, 2.0, 240, 2)
    rounds = args.rounds or rounds
    torch.manual_seed(0)
    checkpoint = load_checkpoint(bundled_model_path())
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", max_num_seqs=32 if args.quick else 64))
    seats = engine.scheduler.max_num_seqs
    throughput(engine, seats, 8)  # warm-up: the first steps of a fresh engine are slower
    print(f"load average at start: {os.getloadavg()}")
    if "burst" in parts:
        for is_fair in (True, False):
            engine.scheduler.is_fair = is_fair
            ttfts = asyncio.run(b_ttfts(engine, num_a, 64, num_b, delay_s))
            name = "fair" if is_fair else "FCFS"
            worst, p50 = max(ttfts), statistics.median(ttfts)
            print(f"burst {name}: A {num_a}x64, B x{num_b}: worst {worst:.2f}s p50 {p50:.2f}s")
        engine.scheduler.is_fair = True
        beside = asyncio.run(b_ttfts(engine, seats, 64, num_b, delay_s))
        print(f"B beside {seats} running A streams (no queue): p50 {statistics.median(beside):.2f}s")
    if "alone" in parts:
        rates: dict[bool, list[float]] = {True: [], False: []}
        cpu_rates: dict[bool, list[float]] = {True: [], False: []}
        for round_index in range(rounds):  # FCFS first, then fair first, ... (a run's place must not favour it)
            for is_fair in (False, True) if round_index % 2 == 0 else (True, False):
                engine.scheduler.is_fair = is_fair
                rates[is_fair].append(throughput(engine, seats, 64, cpu_rates[is_fair]))
        fair, fcfs = max(rates[True]), max(rates[False])
        print(f"one tenant: fair {fair:.1f} tok/s, FCFS {fcfs:.1f} tok/s ({fair / fcfs - 1:+.1%}), best of {rounds}")
        fair, fcfs = statistics.median(rates[True]), statistics.median(rates[False])
        print(f"  medians: fair {fair:.1f} tok/s, FCFS {fcfs:.1f} tok/s ({fair / fcfs - 1:+.1%})")
        pairs = zip(rates[False], rates[True], strict=True)
        print(f"  rounds (FCFS, fair): {[(round(a, 1), round(b, 1)) for a, b in pairs]}")
        fair, fcfs = statistics.median(cpu_rates[True]), statistics.median(cpu_rates[False])
        print(f"  per CPU-second, medians: fair {fair:.1f} tok, FCFS {fcfs:.1f} tok ({fair / fcfs - 1:+.1%})")
        pairs = zip(cpu_rates[False], cpu_rates[True], strict=True)
        print(f"  rounds per CPU-second (FCFS, fair): {[(round(a, 1), round(b, 1)) for a, b in pairs]}")
        # What fairness itself costs per step, without the model's run-to-run swing: the scheduler alone.
        costs = {is_fair: min(scheduling_s(seats, 64, is_fair=is_fair) for _ in range(5)) for is_fair in (False, True)}
        (fcfs_s, num_steps), (fair_s, _) = costs[False], costs[True]
        print(
            f"  the scheduler alone, {seats}x64 one tenant: fair {fair_s / num_steps * 1e6:.0f} us/step, "
            f"FCFS {fcfs_s / num_steps * 1e6:.0f} us/step ({num_steps} steps)"
        )
    engine.scheduler.is_fair = True
    for weights in ((1.0, 1.0), (3.0, 1.0)) if "shares" in parts else ():
        ratio, elapsed = served_ratio(engine, weights, num_steps)
        print(
            f"two saturating tenants, weights {weights[0]:g}:{weights[1]:g}: served {ratio:.2f}:1 "
            f"over {num_steps} steps ({elapsed:.1f} s)"
        )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
