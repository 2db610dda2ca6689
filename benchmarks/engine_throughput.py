"""Engine throughput on the bundled SmolLM2-135M-Instruct, against transformers' static batching, in one run.

    python benchmarks/engine_throughput.py            # the issue's workload (takes several minutes on 2 cores)
    python benchmarks/engine_throughput.py --quick    # a smaller run (about a minute)
    python benchmarks/engine_throughput.py --rounds 3 # three alternating rounds, each round's ratio and the median

Workload: N requests with prompt lengths uniform in [32, 600] tokens and output lengths uniform in [16, 256]
(ignore_eos + min_tokens pin each output length), all submitted at once. Reported:
- our engine: useful generated tokens/s, TTFT and end-to-end p50/p95, KV utilisation (tokens stored / slots
  allocated, sampled every step), preemptions;
- transformers `generate` in static batches (8 and 32) with left padding: the same figures, where a batch runs
  until its longest output (the other slots are padding) and every request in it ends when the batch ends;
- batch-1: TTFT and decode tokens/s for a 200-token prompt, both engines;
- the engine's throughput over the best static batching's. On a shared machine whose speed swings (up to 2x over
  minutes on the hosts this was measured on), a ratio of runs minutes apart measures the swing as much as the
  engines: `--rounds N` runs the engine and the static batches N times, alternating, and reports each round's
  ratio and their median.
Greedy decoding everywhere, float32 by default (the figures the issue asks for).

`--profile-ops` also prints where the engine's run went: seconds in each of the engine's ops, the projections,
the logits and the sampler (timers wrapped around them for that run only). Decode steps that run the decoder stack
in one native call (`local_engine/cpu_decode.py`, on by default on CPU) count as one item, their ops unseen;
`--no-fused-decode` times them op by op. `--no-gguf-blocks` keeps the decode projections on float32 panels
instead of the GGUF file's own Q4_1/Q8_0 blocks (the same results; more bytes per decode step).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.loader import bundled_model_path, load_checkpoint
from local_engine.sampling_params import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    num_output: int


@dataclass
class RunResult:
    name: str
    elapsed_s: float
    num_useful_tokens: int
    ttft_s: list[float]
    e2e_s: list[float]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_useful_tokens / self.elapsed_s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_workload(
    num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 1234
) -> list[Request]:
    rng = random.Random(seed)
    # Ordinary tokens only (SmolLM2's special tokens sit at the start of the vocabulary).
    return [
        Request([rng.randrange(200, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(num)
    ]


def greedy(num_output: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_output, min_tokens=num_output, ignore_eos=True)


# -- our engine ---------------------------------------------------------------------------------------------------


def run_engine(engine: LLMEngine, requests: list[Request]) -> RunResult:
    # Random prompts share nothing, but start from a clean cache anyway: a later round must not find the last one's.
    engine.block_manager.reset_prefix_cache()
    hits_before = engine.block_manager.num_hit_tokens
    started = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    for i, request in enumerate(requests):
        engine.add_request(str(i), request.prompt, greedy(request.num_output))
    utilisation: list[float] = []
    num_steps = 0
    while engine.has_unfinished_requests:
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
        if engine.scheduler.running:
            utilisation.append(engine.kv_utilization())
    elapsed = time.perf_counter() - started
    ids = [str(i) for i in range(len(requests))]
    return RunResult(
        "unigate engine",
        elapsed,
        sum(r.num_output for r in requests),
        [first[i] - started for i in ids],
        [done[i] - started for i in ids],
        {
            "steps": num_steps,
            "preemptions": engine.scheduler.num_preemptions,
            "kv_utilisation_mean": statistics.fmean(utilisation) if utilisation else 1.0,
            "kv_utilisation_min": min(utilisation) if utilisation else 1.0,
            "prefix_hit_tokens": engine.block_manager.num_hit_tokens - hits_before,
        },
    )


OP_NAMES = (
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "apply_rotary",
    "silu_and_mul",
)


@contextmanager
def op_timers(engine: LLMEngine) -> Iterator[Counter[str]]:
    """Seconds spent in each engine op, the projections (every call of the model's linear class, the output
    projection included), the logits, the sampler and the native decode steps while the block runs; the wrappers
    are removed after it."""
    totals: Counter[str] = Counter()

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - started

        return wrapper

    model = engine.runner.model
    layer = model.model.layers[0]
    linear_class = type(layer.mlp.down_proj)
    sampler_class = type(engine.sampler)
    patches: list[tuple[object, str, str]] = [(layer.self_attn.ops, name, name) for name in OP_NAMES]
    patches += [
        (linear_class, "forward", "projections"),
        (model, "compute_logits", "logits"),
        (sampler_class, "__call__", "sampler"),
    ]
    if engine.runner.cpu_decoder is not None:  # decode steps in one native call: their ops are not seen one by one
        patches.append((engine.runner.cpu_decoder, "run", "decode steps (cpu_decode)"))
    saved = [(owner, name, owner.__dict__.get(name), getattr(owner, name)) for owner, name, _ in patches]
    for (owner, name, label), (*_, fn) in zip(patches, saved, strict=True):
        setattr(owner, name, timed(label, fn))
    try:
        yield totals
    finally:
        for owner, name, own, _ in saved:
            if own is None:
                delattr(owner, name)  # an instance attribute shadowing its class's method
            else:
                setattr(owner, name, own)


def report_ops(totals: Counter[str], elapsed: float) -> None:
    print(f"\nwhere the engine's {elapsed:.1f} s went (the logits' projection is also counted in projections):")
    for label, seconds in totals.most_common():
        print(f"  {label:24} {seconds:7.2f} s  {100 * seconds / elapsed:5.1f}%")


def engine_batch1(engine: LLMEngine, prompt: list[int], num_output: int) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s after the first token)."""
    engine.add_request("b1", prompt, greedy(num_output))
    started = time.perf_counter()
    first = 0.0
    while engine.has_unfinished_requests:
        outputs = engine.step()
        if outputs and not first:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - started, (num_output - 1) / (end - first)


# -- transformers ---------------------------------------------------------------------------------------------------


class StepClock:
    """A stopping criterion that never stops: it records when each generation step finishes."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def hf_generate(model: Any, prompts: list[list[int]], num_new: int, pad_id: int) -> StepClock:
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = StepClock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=pad_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    return clock


def run_hf_static(model: Any, requests: list[Request], batch_size: int, pad_id: int) -> RunResult:
    started = time.perf_counter()
    ttft: list[float] = []
    e2e: list[float] = []
    num_slots = 0
    for offset in range(0, len(requests), batch_size):
        batch = requests[offset : offset + batch_size]
        num_new = max(r.num_output for r in batch)
        clock = hf_generate(model, [r.prompt for r in batch], num_new, pad_id)
        num_slots += num_new * len(batch)
        ttft += [clock.times[0] - started] * len(batch)
        e2e += [clock.times[-1] - started] * len(batch)  # static batching returns everything at the end
    elapsed = time.perf_counter() - started
    useful = sum(r.num_output for r in requests)
    return RunResult(
        f"transformers static bs={batch_size}", elapsed, useful, ttft, e2e, {"padding_slots": 1 - useful / num_slots}
    )


def hf_batch1(model: Any, prompt: list[int], num_output: int, pad_id: int) -> tuple[float, float]:
    started = time.perf_counter()
    clock = hf_generate(model, [prompt], num_output, pad_id)
    return clock.times[0] - started, (num_output - 1) / (clock.times[-1] - clock.times[0])


def load_hf_model(checkpoint: Any, dtype: torch.dtype) -> Any:
    """transformers' LlamaForCausalLM on the very same weights the engine serves."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**checkpoint.hf_config)
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(checkpoint.state_dict, strict=False)
    model.tie_weights()
    return model.eval()


# -- report -----------------------------------------------------------------------------------------------------


def report(results: list[RunResult]) -> None:
    header = f"{'':34} {'tok/s':>8} {'wall s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'E2E p50':>8} {'E2E p95':>8}"
    print(header)
    for r in results:
        print(
            f"{r.name:34} {r.tokens_per_s:8.1f} {r.elapsed_s:8.1f} {percentile(r.ttft_s, 0.5):9.2f} "
            f"{percentile(r.ttft_s, 0.95):9.2f} {percentile(r.e2e_s, 0.5):8.2f} {percentile(r.e2e_s, 0.95):8.2f}"
            + "".join(f"  {k}={v:.3f}" if isinstance(v, float) else f"  {k}={v}" for k, v in r.extra.items())
        )


def report_ratios(rounds: list[list[RunResult]]) -> None:
    """The engine's throughput over the best static batching's, per round (runs minutes apart on a machine whose
    speed swings compare fairly only within a round), and the median of the rounds' ratios."""
    ratios = []
    for runs in rounds:
        engine, best = runs[0].tokens_per_s, max(r.tokens_per_s for r in runs[1:])
        ratios.append(engine / best)
        if len(rounds) > 1:
            print(f"  {runs[0].name}: {engine:.1f} tok/s vs best static {best:.1f} tok/s = {ratios[-1]:.2f}x")
    label = f"median of {len(rounds)} rounds" if len(rounds) > 1 else "best static batching"
    print(f"\nthroughput vs {label}: {statistics.median(ratios):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 shorter requests, static batch 8 only")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    parser.add_argument("--cache-dir", type=Path, default=Path(".unigate/models"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--no-pack-cpu-weights", action="store_true", help="plain torch.nn.Linear (MKL) instead of oneDNN packed GEMMs"
    )
    parser.add_argument("--profile-ops", action="store_true", help="time each engine op during the engine's run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the engine's run and transformers' static runs this many times, alternating, and report each "
        "round's ratio and their median (a shared machine's speed swings over minutes)",
    )
    parser.add_argument(
        "--no-cpu-kernels",
        action="store_true",
        help="torch ops instead of the native CPU kernels (decode attention, rotary)",
    )
    parser.add_argument(
        "--no-fused-decode",
        action="store_true",
        help="decode steps op by op instead of the decoder stack in one native call (cpu_decode.py)",
    )
    parser.add_argument(
        "--no-gguf-blocks",
        action="store_true",
        help="decode projections on float32 panels instead of the GGUF file's own Q4_1/Q8_0 blocks",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    started = time.perf_counter()
    checkpoint = load_checkpoint(bundled_model_path(), cache_dir=args.cache_dir, dtype=dtype)
    print(f"loaded the bundled model in {time.perf_counter() - started:.1f}s (from cache: {checkpoint.from_cache})")
    vocab = int(checkpoint.hf_config["vocab_size"])
    if args.quick:
        requests = make_workload(args.num_requests or 8, (32, 200), (16, 64), vocab)
        batch_sizes, batch1_output = [8], 32
    else:
        requests = make_workload(args.num_requests or 32, (32, 600), (16, 256), vocab)
        batch_sizes, batch1_output = [8, 32], 128
    config = EngineConfig(
        device="cpu",
        dtype=args.dtype,
        kv_cache_memory=2 * 2**30,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        pack_cpu_weights=not args.no_pack_cpu_weights,
        cpu_kernels=not args.no_cpu_kernels,
        cpu_fused_decode=not args.no_fused_decode,
        cpu_gguf_blocks=not args.no_gguf_blocks,
    )
    engine = LLMEngine.from_checkpoint(checkpoint, config)
    print(f"KV cache: {engine.capacity.as_dict()}")
    print(f"decode projections on the GGUF file's blocks: {engine.stats()['gguf_block_panels'] or 'no'}")
    num_prompt = sum(len(r.prompt) for r in requests)
    print(
        f"workload: {len(requests)} requests, {num_prompt} prompt tokens, {sum(r.num_output for r in requests)} "
        f"output tokens, threads={torch.get_num_threads()}, dtype={args.dtype}"
    )
    engine.generate([requests[0].prompt[:16]], greedy(4))  # warm-up
    model: Any = None
    pad_id = int(checkpoint.hf_config.get("pad_token_id") or 0)
    if not args.skip_hf:
        model = load_hf_model(checkpoint, dtype)
        hf_generate(model, [requests[0].prompt[:16]], 2, pad_id)  # warm-up
    rounds: list[list[RunResult]] = []  # per round: the engine's run, then transformers' static runs
    for index in range(max(1, args.rounds)):
        if args.profile_ops and index == 0:
            with op_timers(engine) as totals:
                runs = [run_engine(engine, requests)]
            report_ops(totals, runs[0].elapsed_s)
        else:
            runs = [run_engine(engine, requests)]
        if model is not None:
            runs += [run_hf_static(model, requests, batch_size, pad_id) for batch_size in batch_sizes]
        if args.rounds > 1:
            for run in runs:
                run.name += f" #{index + 1}"
        rounds.append(runs)
    batch1_prompt = make_workload(1, (200, 200), (1, 1), vocab, seed=99)[0].prompt  # shares no prefix
    engine_b1 = engine_batch1(engine, batch1_prompt, batch1_output)
    hf_b1 = None if model is None else hf_batch1(model, batch1_prompt, batch1_output, pad_id)
    print()
    report([run for runs in rounds for run in runs])
    print()
    print(f"batch-1, 200-token prompt, {batch1_output} new tokens:")
    print(f"  unigate engine  TTFT {engine_b1[0] * 1000:7.0f} ms   decode {engine_b1[1]:6.1f} tok/s")
    if hf_b1 is not None:
        print(f"  transformers    TTFT {hf_b1[0] * 1000:7.0f} ms   decode {hf_b1[1]:6.1f} tok/s")
        report_ratios(rounds)


if __name__ == "__main__":
    main()
