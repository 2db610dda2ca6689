"""Calibrate the replica simulator (tests/fakes/replica_sim.py) against the bundled engine, on this host.

    .venv/bin/python benchmarks/calibrate_replica_sim.py [--out tests/fakes/replica_sim_bundled_engine.json]

The engine is the local engine as the gateway runs the bundled SmolLM2-135M-Instruct by default (`EngineConfig()`
resolved for this host: float32 on CPU, a 512 MiB KV cache, 64 sequences, 2,048 tokens per step), driven step by
step (`LLMEngine.step`). Measured:
- prefill: one request with a fresh random prompt of each `--prompt-lens` length and one output token, on an empty
  prefix cache; its step's seconds against the prompt length, fitted to a line (the slope is `prefill_s_per_token`);
- decode: `--batch-sizes` requests at once, each `--decode-context` tokens in (a shared prefix, cached), with
  `--decode-steps` output tokens each (EOS ignored); the median of the steps after the prefill step, fitted to
  `decode_step_s + decode_s_per_seq * batch`. The engine's step grows with the context (attention reads every
  earlier token), the simulator's does not: pick the context of the workload the simulator stands in for;
- the prefix cache as configured: its block size (`block_tokens`), its capacity (every KV block can hold a cached
  prefix: `num_cache_blocks`) and the most sequences a step runs (`max_batch`);
- `chars_per_token`: the tokenizer on the validation workload's text (the simulator counts characters).
The fitted `SimParams` are printed and written to `--out` (JSON: `params`, what they came from, and the validation).

Validation: the same small workload (`--sessions` conversations of `--turns` turns, started together, each turn
resending the conversation so far plus a new user message, `--max-tokens` output tokens, streamed) on the real
engine (`AsyncEngine`, the prompt text tokenized) and on one simulated replica with the fitted parameters (HTTP, as
the routing benchmarks use it); reported: TTFT p50 and the total time of each, and simulated over measured.
`--rounds N` calibrates and validates N times in turn and writes each parameter's median over the rounds.
`--model` runs it all on another checkpoint (a tiny random one in the test).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fakes.replica_sim import CALIBRATION_PATH, ReplicaFleet, SimParams, render_prompt  # noqa: E402

from local_engine.async_engine import AsyncEngine  # noqa: E402
from local_engine.config import EngineConfig  # noqa: E402
from local_engine.engine import LLMEngine  # noqa: E402
from local_engine.loader import bundled_model_path, load_checkpoint  # noqa: E402
from local_engine.sampling_params import SamplingParams  # noqa: E402
from local_engine.tokenizer import Tokenizer  # noqa: E402

TEXT = (ROOT / "local_engine" / "data" / "us-constitution.txt").read_text()


def fixed_output(num_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens, ignore_eos=True)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares `y = a + b x`: (a, b)."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mean_x) ** 2 for x in xs)
    slope = num / den
    return mean_y - slope * mean_x, slope


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    low = min(200, vocab // 2)  # ordinary tokens (SmolLM2's special tokens sit at the start of the vocabulary)
    return [rng.randrange(low, vocab) for _ in range(length)]


def timed_steps(engine: LLMEngine) -> list[float]:
    """Run the engine until its requests finish; each step's seconds."""
    seconds = []
    while engine.has_unfinished_requests:
        started = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def measure_prefill(engine: LLMEngine, lengths: list[int], repeats: int, vocab: int) -> dict[int, float]:
    """Prompt length -> median seconds to prefill it (one output token, nothing cached)."""
    rng = random.Random(1)
    result = {}
    for length in lengths:
        samples: list[float] = []
        for _ in range(repeats):
            engine.block_manager.reset_prefix_cache()
            engine.add_request(f"p{length}-{len(samples)}", random_prompt(rng, length, vocab), fixed_output(1))
            samples.append(sum(timed_steps(engine)))
        result[length] = statistics.median(samples)
    return result


def measure_decode(
    engine: LLMEngine, batch_sizes: list[int], num_steps: int, context: int, vocab: int
) -> dict[int, float]:
    """Batch size -> median seconds of a decode step with that many sequences running, each `context` tokens into
    its sequence (a decode step reads every earlier token's KV). The sequences share their first `context` tokens,
    prefilled once beforehand, so that only their last few tokens are prefilled per batch."""
    rng = random.Random(2)
    prefix = random_prompt(rng, context, vocab)
    engine.block_manager.reset_prefix_cache()
    engine.add_request("prefix", prefix, fixed_output(1))
    timed_steps(engine)
    result = {}
    for batch in batch_sizes:
        for index in range(batch):
            prompt = prefix + random_prompt(rng, 8, vocab)
            engine.add_request(f"d{batch}-{index}", prompt, fixed_output(num_steps + 1))
        steps = timed_steps(engine)
        result[batch] = statistics.median(steps[1:])  # the first step prefills them all
    return result


# -- validation -----------------------------------------------------------------------------------------------------


@dataclass
class RunTimes:
    ttft_s: list[float]
    total_s: float
    hit_rate: float = 0.0  # prompt tokens found in the prefix cache over all prompt tokens


def workload(num_sessions: int, num_turns: int, max_tokens: int, chars_per_token: int) -> list[list[dict[str, Any]]]:
    """Per session, per turn, the chat request body: a shared system prompt (~300 tokens), then each turn the
    conversation so far (earlier user messages, replies of `max_tokens` tokens' worth of text) and a new user
    message (~100 tokens); all text from the evaluation document, so the real tokenizer sees ordinary English."""
    system = TEXT[:1200]
    reply = TEXT[-max_tokens * chars_per_token :]
    offset = 1200
    sessions = []
    for _ in range(num_sessions):
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        bodies = []
        for _ in range(num_turns):
            messages.append({"role": "user", "content": TEXT[offset : offset + 400]})
            offset += 400
            bodies.append({"model": "sim", "messages": list(messages), "max_tokens": max_tokens, "stream": True})
            messages.append({"role": "assistant", "content": reply})
        sessions.append(bodies)
    return sessions


async def run_workload(
    sessions: list[list[dict[str, Any]]], send: Callable[[dict[str, Any]], Awaitable[float]]
) -> RunTimes:
    """Sessions at once, each turn after the previous one's answer; `send` returns the request's TTFT."""
    ttfts: list[float] = []

    async def session(bodies: list[dict[str, Any]]) -> None:
        for body in bodies:
            ttfts.append(await send(body))

    started = time.perf_counter()
    await asyncio.gather(*(session(bodies) for bodies in sessions))
    return RunTimes(ttfts, time.perf_counter() - started)


async def run_on_engine(engine: LLMEngine, tokenizer: Tokenizer, sessions: list[list[dict[str, Any]]]) -> RunTimes:
    engine.block_manager.reset_prefix_cache()
    async_engine = AsyncEngine(engine)

    async def send(body: dict[str, Any]) -> float:
        prompt = tokenizer.encode(render_prompt(body))
        started = time.perf_counter()
        ttft = 0.0
        async for _ in async_engine.generate(prompt, fixed_output(body["max_tokens"])):
            ttft = ttft or time.perf_counter() - started
        return ttft

    blocks = engine.block_manager
    num_hit, num_queried = blocks.num_hit_tokens, blocks.num_queried_tokens
    try:
        times = await run_workload(sessions, send)
    finally:
        await async_engine.shutdown()
    times.hit_rate = (blocks.num_hit_tokens - num_hit) / (blocks.num_queried_tokens - num_queried)
    return times


async def run_on_sim(params: SimParams, sessions: list[list[dict[str, Any]]]) -> RunTimes:
    with ReplicaFleet(1, params) as fleet:
        url = f"{fleet.replicas[0].base_url}/chat/completions"
        async with aiohttp.ClientSession() as http:

            async def send(body: dict[str, Any]) -> float:
                started = time.perf_counter()
                ttft = 0.0
                async with http.post(url, json=body) as response:
                    async for _ in response.content:
                        ttft = ttft or time.perf_counter() - started
                return ttft

            times = await run_workload(sessions, send)
        stats = fleet.replicas[0].stats
    times.hit_rate = stats.num_cached_tokens / stats.num_prompt_tokens
    return times


# -- main -------------------------------------------------------------------------------------------------------


def calibrate(
    engine: LLMEngine, tokenizer: Tokenizer, args: argparse.Namespace, vocab: int
) -> tuple[SimParams, dict[str, Any]]:
    engine.generate([random_prompt(random.Random(0), 16, vocab)], fixed_output(4))  # warm-up
    prefill = measure_prefill(engine, args.prompt_lens, args.repeats, vocab)
    decode = measure_decode(engine, args.batch_sizes, args.decode_steps, args.decode_context, vocab)
    prefill_fixed_s, prefill_s_per_token = fit_line([float(n) for n in prefill], list(prefill.values()))
    decode_step_s, decode_s_per_seq = fit_line([float(b) for b in decode], list(decode.values()))
    text = "".join(render_prompt(bodies[-1]) for bodies in workload(args.sessions, args.turns, args.max_tokens, 4))
    num_text_tokens = len(tokenizer.encode(text))
    config = engine.engine_config
    params = SimParams(
        chars_per_token=max(1, round(len(text) / num_text_tokens)),
        block_tokens=config.block_size,
        num_cache_blocks=engine.capacity.num_blocks,
        # a line fitted to noisy timings may dip below zero; the simulator needs a cost
        prefill_s_per_token=max(prefill_s_per_token, 1e-7),
        decode_step_s=max(decode_step_s, 1e-5),
        decode_s_per_seq=max(decode_s_per_seq, 1e-7),
        max_batch=config.max_num_seqs,
    )
    measured = {
        "prefill_s_by_prompt_tokens": {str(k): round(v, 6) for k, v in prefill.items()},
        "prefill_fixed_s": round(prefill_fixed_s, 6),
        "decode_step_s_by_batch": {str(k): round(v, 6) for k, v in decode.items()},
        "decode_context_tokens": args.decode_context,
        "chars_per_token": round(len(text) / num_text_tokens, 3),
        "kv_cache_tokens": engine.capacity.num_tokens,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    return params, measured


def validate(engine: LLMEngine, tokenizer: Tokenizer, params: SimParams, args: argparse.Namespace) -> dict[str, float]:
    sessions = workload(args.sessions, args.turns, args.max_tokens, params.chars_per_token)
    real = asyncio.run(run_on_engine(engine, tokenizer, sessions))
    sim = asyncio.run(run_on_sim(params, sessions))
    engine_ttft, sim_ttft = statistics.median(real.ttft_s), statistics.median(sim.ttft_s)
    for name, run, ttft in (("engine", real, engine_ttft), ("simulator", sim, sim_ttft)):
        print(f"  {name:10} TTFT p50 {ttft * 1000:8.1f} ms  total {run.total_s:6.2f} s  hit rate {run.hit_rate:.2f}")
    print(f"  simulated / measured: TTFT p50 {sim_ttft / engine_ttft:.2f}, total {sim.total_s / real.total_s:.2f}")
    return {
        "engine_ttft_p50_s": round(engine_ttft, 4),
        "sim_ttft_p50_s": round(sim_ttft, 4),
        "engine_total_s": round(real.total_s, 3),
        "sim_total_s": round(sim.total_s, 3),
        "ttft_p50_ratio": round(sim_ttft / engine_ttft, 3),
        "total_ratio": round(sim.total_s / real.total_s, 3),
        "engine_hit_rate": round(real.hit_rate, 3),
        "sim_hit_rate": round(sim.hit_rate, 3),
    }


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each field's median over the rounds (the lower middle one: a value a round measured), nested dicts too."""
    first = rounds[0]
    return {
        name: median_of([r[name] for r in rounds])
        if isinstance(value, dict)
        else statistics.median_low(r[name] for r in rounds)
        for name, value in first.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=CALIBRATION_PATH)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint other than the bundled model")
    parser.add_argument("--cache-dir", type=Path, default=Path(".unigate/models"))
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: the engine's default)")
    parser.add_argument("--prompt-lens", type=lambda s: [int(v) for v in s.split(",")], default=[64, 256, 512, 1024])
    parser.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument(
        "--decode-context",
        type=int,
        default=512,
        help="tokens before each decoded one (the simulator's step does not grow with it; the engine's does)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="calibrate and validate this many times in turn; the parameters written are each one's median over the "
        "rounds (a shared host's speed swings over minutes)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine (default: torch's, one per core); 1 on a host whose cores are busy: "
        "threads that wait for each other at every op slow down many times over when another process takes a core",
    )
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model or bundled_model_path(), cache_dir=args.cache_dir)
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(device="cpu", kv_cache_memory=args.kv_cache_memory))
    vocab = int(checkpoint.hf_config["vocab_size"])
    workload_text = f"{args.sessions} sessions x {args.turns} turns, {args.max_tokens} output tokens, streamed"
    rounds: list[dict[str, Any]] = []
    for index in range(max(1, args.rounds)):
        params, measured = calibrate(engine, checkpoint.tokenizer, args, vocab)
        print(f"round {index + 1} measured:", orjson.dumps(measured, option=orjson.OPT_INDENT_2).decode())
        print(f"round {index + 1} fitted:", params)
        print(f"round {index + 1} validation ({workload_text}):")
        validation = validate(engine, checkpoint.tokenizer, params, args)
        fitted = {
            k: v for k, v in asdict(params).items() if k not in ("max_waiting", "default_max_tokens", "time_scale")
        }
        rounds.append({"params": fitted, "measured": measured, "validation": validation})

    summary = median_of(rounds)
    print(f"median of {len(rounds)} round(s): {SimParams(**summary['params'])}")
    print(f"  simulated / measured: TTFT p50 {summary['validation']['ttft_p50_ratio']:.2f}, ", end="")
    print(f"total {summary['validation']['total_ratio']:.2f}")
    document = {
        "params": summary["params"],
        "model": str(args.model or "bundled SmolLM2-135M-Instruct (Q4_1 GGUF, float32)"),
        "engine_config": "EngineConfig() defaults on CPU" + (" (kv_cache_memory set)" if args.kv_cache_memory else ""),
        "measured_on": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "torch_threads": torch.get_num_threads(),
            "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "measured": summary["measured"],  # each point's median over the rounds
        "validation": {"workload": workload_text, **summary["validation"]},  # each figure's median over the rounds
        "rounds": rounds,
    }
    args.out.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
