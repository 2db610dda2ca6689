"""Routing policies on a simulated fleet: a multi-turn agent trace through the gateway to 4 and 16 replicas.

    .venv/bin/python benchmarks/fleet_routing.py [--replicas 4,16] [--sessions 48] [--turns 8] [--quick]

The fleet is tests/fakes/replica_sim.py (vLLM-like replicas: a prefix cache, prefill per uncached token, decode
steps growing with the batch, `/metrics`), all on one event loop in this process (`--preset vllm-h100`, the
default, or `bundled-engine`: the calibration of benchmarks/calibrate_replica_sim.py); the gateways are `create_app`
under uvicorn in threads, on one embedded Redis (master key; the instances share prefix_affinity's moves through
it, gateway/placement_sync.py). The trace: `--sessions` agent sessions, each over one of `--prompts`
shared system prompts of 2-6k tokens, each turn resending the whole conversation plus a tool result of 150-600
tokens, streamed; sessions start staggered and think 0.1-0.5 s between turns. Each policy runs the same trace on a
fresh fleet:

- `round_robin`, `least_in_flight` (today's default), `least_load` (the replicas' own metrics, polled every 0.25 s
  here), `prefix_affinity` (consistent hashing with bounded loads); and `prefix_affinity` through two gateway
  instances taking alternate turns (`--two-gateways`, on by default).

Reported per policy: the prefix-cache hit rate (cached / prompt tokens over the fleet) and its share of one
infinitely large replica's on the same trace; TTFT p50 / p90 (client-side, streaming) and p50 against
`least_in_flight`'s; the busiest replica's time-averaged load (running + waiting) over the mean's, and its request
count over the mean's. Times are simulated seconds (`--time-scale` < 1 runs faster and divides them back).

Then SLO-aware admission (`--no-slo` skips it, `--slo-only` runs only it): `--slo-replicas` replicas of a smaller
GPU's worth (`SLO_SIM`: a batch of at most 16, a 20 ms decode step growing 2 ms per running request) under an SLO of
TTFT 500 ms and TPOT 40 ms, offered `--slo-overload` (2) times the fleet's capacity as Poisson arrivals for
`--slo-seconds`: streamed requests of a ~200-token prompt (each its own, no prefix shared) and 32 output tokens. The
capacity is the fleet's throughput at the largest batch whose decode step meets the TPOT target (`slo_capacity`).
Run without `slo`, with it (no seed: the limits start at 1), and with it seeded (`max_concurrency`: that batch);
reported: requests served and shed, the SLO goodput (requests/s that met both targets as the client saw them,
queueing included, over the arrival window), the attainment, TTFT / TPOT p95 of the served, and the longest wait of
an admitted request against its deadline (`gateway.slo_admission.slo_states`, what `GET /admin/models` shows).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fakes.replica_sim import ReplicaFleet, SimParams, prompt_blocks, render_prompt  # noqa: E402
from fakes.server import ThreadedServer  # noqa: E402

from auth.access import AccessConfig, RedisAccess  # noqa: E402
from auth.embedded_redis import EmbeddedRedis  # noqa: E402
from auth.redis_client import connect  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.routing_config import parse_routing  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from gateway.slo_admission import slo_states  # noqa: E402

MASTER = "sk-ug-bench-fleet-0123456789abcdef"
SLO_SIM = {"max_batch": 16, "decode_step_s": 0.02, "decode_s_per_seq": 0.002}
SLO_TTFT_MS, SLO_TPOT_MS, SLO_OUT_TOKENS, SLO_PROMPT_TOKENS = 500.0, 40.0, 32, 200
POLICIES = ("round_robin", "least_in_flight", "least_load", "prefix_affinity")
WORDS = "alpha beta gamma delta error build test module import return value class const patch diff".split()


@dataclass
class Turn:
    session: int
    messages: list[dict[str, str]]


@dataclass
class Result:
    policy: str
    num_replicas: int
    hit_rate: float
    ttfts: list[float]
    busiest_load: float  # busiest replica's time-averaged load / the mean's
    busiest_requests: float  # busiest replica's requests / the mean's
    seconds: float


def text(rng: random.Random, num_tokens: int, tag: str) -> str:
    """About `num_tokens` tokens (4 characters each) of varied text starting with `tag`."""
    words = [tag]
    while sum(len(w) + 1 for w in words) < num_tokens * 4:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def make_trace(args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """The system prompts, and per session its user/tool messages (one per turn)."""
    rng = random.Random(7)
    systems = [text(rng, rng.randint(2000, 6000), f"system-{i}") for i in range(args.prompts)]
    sessions = [
        [text(rng, 200 if t == 0 else rng.randint(150, 600), f"s{s}-t{t}") for t in range(args.turns)]
        for s in range(args.sessions)
    ]
    return systems, sessions


def infinite_hit_rate(systems: list[str], sessions: list[list[str]], params: SimParams, out_tokens: int) -> float:
    """The hit rate of one replica with an unbounded prefix cache on the same trace (order-independent: with chained
    block hashes, every distinct block misses exactly once)."""
    seen: set[bytes] = set()
    prompt = cached = 0
    for index, turns in enumerate(sessions):
        for turn in range(len(turns)):
            body = {"messages": conversation(systems[index % len(systems)], turns, turn, out_tokens)}
            num_tokens, blocks = prompt_blocks(render_prompt(body), params)
            num_hit = 0
            for block in blocks:
                if block not in seen:
                    break
                num_hit += 1
            seen.update(blocks)
            prompt += num_tokens
            cached += min(num_hit * params.block_tokens, num_tokens - 1)
    return cached / prompt


def conversation(system: str, turns: list[str], turn: int, out_tokens: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}]
    for t in range(1, turn + 1):
        messages += [{"role": "assistant", "content": "tok " * out_tokens}, {"role": "user", "content": turns[t]}]
    return messages


async def run_session(
    http: aiohttp.ClientSession,
    urls: list[str],
    index: int,
    system: str,
    turns: list[str],
    args: argparse.Namespace,
    ttfts: list[float],
) -> None:
    rng = random.Random(index)
    await asyncio.sleep(index * args.stagger_s * args.time_scale)
    for turn in range(len(turns)):
        body = {
            "model": "sim",
            "messages": conversation(system, turns, turn, args.out_tokens),
            "max_tokens": args.out_tokens,
            "stream": True,
        }
        url = urls[(index + turn) % len(urls)]  # two gateways: alternate turns between them
        started = time.perf_counter()
        first = None
        async with http.post(url, json=body, headers={"authorization": f"Bearer {MASTER}"}) as response:
            assert response.status == 200, await response.text()
            async for line in response.content:
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.perf_counter()
        ttfts.append(((first or time.perf_counter()) - started) / args.time_scale)
        await asyncio.sleep(rng.uniform(0.1, 0.5) * args.time_scale)


def routing(fleet: ReplicaFleet, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    deployments = [
        {"type": "openai", "name": f"r{i}", "base_url": r.base_url, "api_key": "sk-sim", "metrics_url": r.metrics_url}
        for i, r in enumerate(fleet.replicas)
    ]
    affinity = {"load_factor": args.load_factor, "load_slack": args.load_slack}
    return {
        "models": [{"id": "sim", "routing": policy, "deployments": deployments, "affinity": affinity}],
        "router": {"metrics_interval_s": 0.25, "metrics_stale_s": 2.0},
    }


def gateway(fleet: ReplicaFleet, policy: str, args: argparse.Namespace) -> ThreadedServer:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER,  # type: ignore[arg-type]
        engine={"enabled": False},  # type: ignore[arg-type]
        health_probe_interval_s=0,
    )
    access = RedisAccess(connect(args.redis_url), config=AccessConfig(), master_key=MASTER)
    app = create_app(
        settings,
        access=access,
        upstream_limiter=access.upstream_limiter,
        routing=parse_routing(routing(fleet, policy, args), source="bench"),
    )
    return ThreadedServer(app, log_level="error").start()


def sim_params(args: argparse.Namespace) -> SimParams:
    preset = SimParams.bundled_engine if args.preset == "bundled-engine" else SimParams.vllm_h100
    return preset(time_scale=args.time_scale)


async def run_policy(
    policy: str, num_replicas: int, num_gateways: int, args: argparse.Namespace, trace: tuple[Any, Any]
) -> Result:
    systems, sessions = trace
    with ReplicaFleet(num_replicas, sim_params(args)) as fleet:
        servers = [gateway(fleet, policy, args) for _ in range(num_gateways)]
        try:
            urls = [f"{s.url}/v1/chat/completions" for s in servers]
            ttfts: list[float] = []
            started = time.perf_counter()
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
                await asyncio.gather(
                    *(
                        run_session(http, urls, i, systems[i % len(systems)], turns, args, ttfts)
                        for i, turns in enumerate(sessions)
                    )
                )
            seconds = (time.perf_counter() - started) / args.time_scale
        finally:
            for server in servers:
                server.stop()
        stats = [r.stats for r in fleet.replicas]
    prompt = sum(s.num_prompt_tokens for s in stats)
    loads = [s.load_seconds for s in stats]
    requests = [s.num_requests for s in stats]
    name = policy if num_gateways == 1 else f"{policy}, 2 gateways"
    return Result(
        policy=name,
        num_replicas=num_replicas,
        hit_rate=sum(s.num_cached_tokens for s in stats) / prompt,
        ttfts=ttfts,
        busiest_load=max(loads) / statistics.mean(loads),
        busiest_requests=max(requests) / statistics.mean(requests),
        seconds=seconds,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[Result], infinite: float) -> None:
    print(f"one infinitely large replica's hit rate on this trace: {infinite:.1%}\n")
    print(
        "| replicas | policy | hit rate | vs infinite | TTFT p50 ms | TTFT p90 ms | p50 vs least_in_flight "
        "| busiest/mean load | busiest/mean requests | s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        same = [r for r in results if r.num_replicas == result.num_replicas]
        baseline = next((r for r in same if r.policy == "least_in_flight"), result)
        p50 = percentile(result.ttfts, 0.5)
        print(
            f"| {result.num_replicas} | {result.policy} | {result.hit_rate:.1%} | {result.hit_rate / infinite:.2f} "
            f"| {p50 * 1000:.0f} | {percentile(result.ttfts, 0.9) * 1000:.0f} "
            f"| {p50 / percentile(baseline.ttfts, 0.5):.2f}x | {result.busiest_load:.2f} "
            f"| {result.busiest_requests:.2f} | {result.seconds:.1f} |"
        )


async def main_async(args: argparse.Namespace) -> None:
    if not args.slo_only:
        trace = make_trace(args)
        infinite = infinite_hit_rate(*trace, sim_params(args), args.out_tokens)
        results = []
        for num_replicas in args.replicas:
            for policy in args.policies:
                results.append(await run_policy(policy, num_replicas, 1, args, trace))
                print(f"  done: {num_replicas} replicas, {policy}", file=sys.stderr, flush=True)
            if args.two_gateways and "prefix_affinity" in args.policies:
                results.append(await run_policy("prefix_affinity", num_replicas, 2, args, trace))
        report(results, infinite)
    if args.slo:
        slo_results = [await run_slo(admission, args) for admission in ("none", "slo", "slo, seeded")]
        slo_report(slo_results, args)


# -- SLO-aware admission at twice the fleet's capacity ---------------------------------------------------------


@dataclass
class SloResult:
    admission: str  # none | slo (the limits start at 1) | slo, seeded (at the capacity's batch: max_concurrency)
    offered_rps: float
    num_sent: int
    num_served: int
    num_shed: int
    num_good: int
    window_s: float
    ttfts: list[float]
    tpots: list[float]
    max_admitted_wait_ms: float | None  # simulated ms
    deadline_ms: float  # simulated ms

    @property
    def goodput(self) -> float:
        return float(self.num_good / self.window_s)


def slo_batch(params: SimParams) -> int:
    """The largest batch whose decode step (`decode_step_s + decode_s_per_seq × batch`) meets the TPOT target."""
    return int(min(params.max_batch, (SLO_TPOT_MS / 1000 - params.decode_step_s) // params.decode_s_per_seq))


def slo_capacity(params: SimParams, num_replicas: int) -> float:
    """Requests/s the fleet serves within the TPOT target: each replica at `slo_batch`, `SLO_OUT_TOKENS` decode
    steps per request (prefill time left out: an upper bound)."""
    batch = slo_batch(params)
    step_s = params.decode_step_s + params.decode_s_per_seq * batch
    return float(num_replicas * batch / (SLO_OUT_TOKENS * step_s))


async def slo_request(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], time_scale: float
) -> tuple[int, float | None, float | None]:
    """`(status, TTFT s, TPOT s)` as the client sees them, in simulated seconds."""
    started = time.perf_counter()
    first = last = None
    num_chunks = 0
    async with http.post(url, json=body, headers={"authorization": f"Bearer {MASTER}"}) as response:
        if response.status != 200:
            await response.read()
            return response.status, None, None
        async for line in response.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                last = time.perf_counter()
                first = first or last
                num_chunks += 1
    if first is None or last is None:
        return 200, None, None
    tpot = (last - first) / (num_chunks - 1) / time_scale if num_chunks > 1 else 0.0
    return 200, (first - started) / time_scale, tpot


async def run_slo(admission: str, args: argparse.Namespace) -> SloResult:
    scale = args.time_scale
    params = SimParams(**SLO_SIM, time_scale=scale)
    rate = args.slo_overload * slo_capacity(params, args.slo_replicas)
    slo = {"ttft_ms": SLO_TTFT_MS * scale, "tpot_ms": SLO_TPOT_MS * scale}
    rng = random.Random(11)
    with ReplicaFleet(args.slo_replicas, params) as fleet:
        seed = {"max_concurrency": slo_batch(params)} if admission == "slo, seeded" else {}
        deployments = [
            {
                "type": "openai",
                "name": f"r{i}",
                "base_url": r.base_url,
                "api_key": "sk-sim",
                "max_connections": 4096,
                **seed,
            }
            for i, r in enumerate(fleet.replicas)
        ]
        model: dict[str, Any] = {"id": "sim", "deployments": deployments}
        if admission != "none":
            model["slo"] = slo
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            master_key=MASTER,  # type: ignore[arg-type]
            engine={"enabled": False},  # type: ignore[arg-type]
            health_probe_interval_s=0,
        )
        app = create_app(settings, routing=parse_routing({"models": [model]}, source="bench"))
        server = ThreadedServer(app, log_level="error").start()
        try:
            url = f"{server.url}/v1/chat/completions"
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as http:
                tasks: list[asyncio.Task[tuple[int, float | None, float | None]]] = []
                started = time.perf_counter()
                at = 0.0
                while at < args.slo_seconds:
                    delay = started + at * scale - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    content = text(rng, SLO_PROMPT_TOKENS, f"request-{len(tasks)}")
                    body = {
                        "model": "sim",
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": SLO_OUT_TOKENS,
                        "stream": True,
                    }
                    tasks.append(asyncio.create_task(slo_request(http, url, body, scale)))
                    at += rng.expovariate(rate)
                outcomes = await asyncio.gather(*tasks)
            waits = [state["max_admitted_wait_ms"] for _, _, state in slo_states(app.state.router.routes)]
        finally:
            server.stop()
    served = [(ttft, tpot) for status, ttft, tpot in outcomes if status == 200 and ttft is not None]
    good = [1 for ttft, tpot in served if ttft * 1000 <= SLO_TTFT_MS and (tpot or 0.0) * 1000 <= SLO_TPOT_MS]
    return SloResult(
        admission=admission,
        offered_rps=rate,
        num_sent=len(outcomes),
        num_served=sum(1 for status, _, _ in outcomes if status == 200),
        num_shed=sum(1 for status, _, _ in outcomes if status == 503),
        num_good=len(good),
        window_s=args.slo_seconds,
        ttfts=[ttft for ttft, _ in served],
        tpots=[tpot for _, tpot in served if tpot is not None],
        max_admitted_wait_ms=max(waits) / scale if waits else None,
        deadline_ms=SLO_TTFT_MS / 2,
    )


def slo_report(results: list[SloResult], args: argparse.Namespace) -> None:
    print(
        f"\nSLO-aware admission: {args.slo_replicas} replicas, SLO TTFT {SLO_TTFT_MS:.0f} ms / TPOT "
        f"{SLO_TPOT_MS:.0f} ms, {args.slo_overload:g}x capacity for {args.slo_seconds:g} s\n"
    )
    print(
        "| admission | offered req/s | sent | served | shed (503) | SLO goodput req/s | attainment "
        "| TTFT p95 ms | TPOT p95 ms | longest admitted wait ms (deadline) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        wait = "-" if result.max_admitted_wait_ms is None else f"{result.max_admitted_wait_ms:.0f}"
        ttft = percentile(result.ttfts, 0.95) * 1000 if result.ttfts else float("nan")
        tpot = percentile(result.tpots, 0.95) * 1000 if result.tpots else float("nan")
        print(
            f"| {result.admission} | {result.offered_rps:.1f} | {result.num_sent} "
            f"| {result.num_served} | {result.num_shed} | {result.goodput:.2f} "
            f"| {result.num_good / max(1, result.num_sent):.1%} | {ttft:.0f} | {tpot:.0f} "
            f"| {wait} ({result.deadline_ms:.0f}) |"
        )
    without = results[0]
    for result in results[1:]:
        if without.goodput:
            print(f"SLO goodput, {result.admission} / none: {result.goodput / without.goodput:.2f}x")
        else:
            print(f"SLO goodput, {result.admission}: {result.goodput:.2f} req/s; none: no request met the SLO")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[4, 16])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--out-tokens", type=int, default=32)
    parser.add_argument("--stagger-s", type=float, default=0.05)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--load-factor", type=float, default=1.5, help="prefix_affinity's affinity.load_factor")
    parser.add_argument("--load-slack", type=int, default=0, help="prefix_affinity's affinity.load_slack")
    parser.add_argument("--no-two-gateways", dest="two_gateways", action="store_false")
    parser.add_argument("--preset", choices=["vllm-h100", "bundled-engine"], default="vllm-h100")
    parser.add_argument("--no-slo", dest="slo", action="store_false", help="skip the SLO-aware admission scenario")
    parser.add_argument("--slo-only", action="store_true", help="only the SLO-aware admission scenario")
    parser.add_argument("--slo-replicas", type=int, default=2)
    parser.add_argument("--slo-overload", type=float, default=2.0, help="offered load over the fleet's capacity")
    parser.add_argument("--slo-seconds", type=float, default=30.0, help="the arrival window (simulated seconds)")
    parser.add_argument("--quick", action="store_true", help="4 replicas, 6 sessions x 2 turns (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.sessions, args.turns, args.slo_seconds = [4], 6, 2, 4.0
    with tempfile.TemporaryDirectory() as directory:
        redis = EmbeddedRedis(Path(directory) / "redis")
        args.redis_url = redis.start()
        try:
            asyncio.run(main_async(args))
        finally:
            redis.stop()


if __name__ == "__main__":
    main()
