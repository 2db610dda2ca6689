"""Speculative decoding (n-gram prompt lookup, draft models) on the bundled SmolLM2-135M-Instruct, float32, on this CPU.

    python benchmarks/speculative.py              # 2 alternating rounds (several minutes on 2 cores)
    python benchmarks/speculative.py --weights gguf   # decode projections on the GGUF's own Q8_0/Q4_1 blocks
    python benchmarks/speculative.py --rounds 3 --max-tokens 192
    python benchmarks/speculative.py --modes off,draft-bf16,draft-layers --rounds 1 --max-tokens 32 --batches 1

Two workloads through the model's chat template, greedy:
- edit: the prompt holds a ~400-token source file and asks for it back with one small change (what coding agents
  send: their outputs repeat their inputs);
- chat: ordinary questions.
Each at batch 1 (requests one after another) and batch 8 (all at once). Modes: `off`, `ngram` (the defaults of
`SpeculativeConfig` but enabled), at batch 8 `ngram-all` (speculation on whatever the batch size), and two drafts
made of the target itself (no smaller model of its family ships here): `draft-bf16` (a bfloat16 copy of the
float32 target) and `draft-layers` (its first `--draft-num-layers` layers, float32). One engine
serves every mode (only its speculator changes), prefix caching off so every run prefills afresh; the modes
alternate within each round because the host's speed swings. Reported per workload, batch and mode: output tok/s
(prefill included) and decode tok/s (after the first token), medians over rounds, TTFT p50, the acceptance rate,
the tokens a verifying sequence gains per step, and whether the greedy outputs equal `off`'s token for token.
"decode tok/s, robust" times every pure-decode step (plain decodes and verifications alike) at the median time of
the steps with as many rows: the shared host's stalls (one step taking 100x its neighbours) drop out.
`--num-tokens`, `--ngram-min`, `--ngram-max` override the defaults the `ngram` modes use.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_engine.config import EngineConfig, SpeculativeConfig
from local_engine.draft import DraftProposer
from local_engine.engine import LLMEngine
from local_engine.loader import Checkpoint, bundled_model_path, load_checkpoint
from local_engine.sampling_params import SamplingParams
from local_engine.speculative import Speculator, build_speculator

ROOT = Path(__file__).resolve().parents[1]
# (source file, the line range kept, the change asked for)
EDITS = [
    ("local_engine/block_manager.py", (96, 140), "rename the variable `num_required` to `num_needed`"),
    ("local_engine/scheduler.py", (56, 98), "rename the method `resolve_max_tokens` to `max_tokens_for`"),
    ("local_engine/sequence.py", (100, 143), "rename the property `num_uncomputed_tokens` to `num_pending_tokens`"),
    ("local_engine/output_processor.py", (60, 100), "rename the variable `full` to `whole`"),
    ("local_engine/sampler.py", (30, 60), "rename the attribute `_generators` to `_rngs`"),
    ("local_engine/speculative.py", (82, 120), "rename the variable `room` to `space`"),
    ("local_engine/config.py", (130, 160), "rename the method `num_tokens` to `token_count`"),
    ("local_engine/metrics.py", (1, 34), "add a comment `# seconds` after every duration"),
]
QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about autumn leaves.",
    "How do vaccines train the immune system?",
    "Suggest a name for a coffee shop and explain why.",
    "What are the main causes of inflation?",
]


@dataclass
class Run:
    tokens: list[list[int]]
    elapsed_s: float
    ttft_s: list[float]
    decode_s: float  # the run's time after each batch's last first token
    robust_decode_s: float  # the pure-decode steps, each at the median time of steps with as many rows
    proposed: int
    accepted: int
    verified: int

    @property
    def num_output(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each request's first, over the time after each batch's prefills."""
        return (self.num_output - len(self.tokens)) / self.decode_s

    @property
    def robust_decode_tok_s(self) -> float:
        return (self.num_output - len(self.tokens)) / self.robust_decode_s


@dataclass
class Cell:
    tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    robust_tok_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    verified: int = 0
    identical: list[bool] = field(default_factory=list)


def edit_prompts(tokenizer: Any) -> list[list[int]]:
    prompts = []
    for path, (first, last), change in EDITS:
        lines = (ROOT / path).read_text().splitlines()[first - 1 : last]
        source = "\n".join(lines)
        message = (
            f"Here is a Python file:\n\n```python\n{source}\n```\n\nReturn the whole file with one change: {change}. "
            "Reply with the code only."
        )
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": message}]))
    return prompts


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


class StepTimer:
    """Times each pure-decode step (plain decodes and verifications) by its number of rows. A stall of the shared
    host lands in a few steps; `robust_s` (each step at its row count's median) does not count it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.times: dict[int, list[float]] = {}
        self.rows = 0
        prepare = engine.runner.prepare

        def timed_prepare(batch: Any) -> Any:
            out = prepare(batch)
            meta = out[2]
            self.rows = out[0].shape[0] if meta.num_decode_tokens == out[0].shape[0] else 0
            return out

        engine.runner.prepare = timed_prepare  # type: ignore[method-assign]

    def record(self, elapsed: float) -> None:
        if self.rows:
            self.times.setdefault(self.rows, []).append(elapsed)
        self.rows = 0

    def robust_s(self) -> float:
        return sum(statistics.median(t) * len(t) for t in self.times.values())


def run_batch(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str, timer: StepTimer
) -> tuple[list, list]:
    started = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    ttft: dict[str, float] = {}
    while engine.has_unfinished_requests:
        step_started = time.perf_counter()
        outputs = engine.step()
        timer.record(time.perf_counter() - step_started)
        for out in outputs:
            for choice in out.outputs:
                if choice.token_ids and out.request_id not in ttft:
                    ttft[out.request_id] = time.perf_counter() - started
                tokens[out.request_id].extend(choice.token_ids)
    return [tokens[r] for r in ids], [ttft[r] for r in ids]


def measure(engine: LLMEngine, prompts: list[list[int]], batch: int, params: SamplingParams, tag: str) -> Run:
    spec = engine.speculator
    before = (spec.num_proposed_tokens, spec.num_accepted_tokens, spec.num_verified_seqs) if spec else (0, 0, 0)
    started = time.perf_counter()
    tokens: list[list[int]] = []
    ttft: list[float] = []
    prefill_s = 0.0
    timer = StepTimer(engine)
    for i in range(0, len(prompts), batch):
        got, first = run_batch(engine, prompts[i : i + batch], params, f"{tag}-{i}", timer)
        tokens += got
        ttft += first
        prefill_s += max(first)
    elapsed = time.perf_counter() - started
    after = (spec.num_proposed_tokens, spec.num_accepted_tokens, spec.num_verified_seqs) if spec else (0, 0, 0)
    engine.runner.prepare = type(engine.runner).prepare.__get__(engine.runner)  # type: ignore[method-assign]
    counts = (a - b for a, b in zip(after, before, strict=True))
    return Run(tokens, elapsed, ttft, elapsed - prefill_s, timer.robust_s(), *counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160, help="output tokens per request (greedy)")
    parser.add_argument("--batch1-requests", type=int, default=8, help="requests run one by one at batch 1")
    parser.add_argument(
        "--weights",
        choices=("float32", "gguf"),
        default="float32",
        help="float32: the GGUF dequantized, float32 panels (the issue's setting); gguf: the decode projections on "
        "the file's own Q4_1/Q8_0 blocks (the CPU default for a GGUF)",
    )
    parser.add_argument("--num-tokens", type=int)
    parser.add_argument("--ngram-min", type=int)
    parser.add_argument("--ngram-max", type=int)
    parser.add_argument("--workloads", default="edit,chat")
    parser.add_argument("--modes", default="off,ngram,ngram-all,draft-bf16,draft-layers")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--draft-num-layers", type=int, default=15, help="layers of the draft-layers mode")
    parser.add_argument("--cache-dir", type=Path, default=Path(".unigate/models"))
    args = parser.parse_args()

    torch.manual_seed(0)
    checkpoint = load_checkpoint(bundled_model_path(), cache_dir=args.cache_dir, dtype=torch.float32)
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_memory=2**30,
        max_num_seqs=64,
        enable_prefix_caching=False,
        cpu_gguf_blocks=args.weights == "gguf",
    )
    print(f"weights: {args.weights}", flush=True)
    engine = LLMEngine.from_checkpoint(checkpoint, config)
    tokenizer = checkpoint.tokenizer
    workloads = {"edit": edit_prompts(tokenizer), "chat": chat_prompts(tokenizer)}
    workloads = {name: workloads[name] for name in args.workloads.split(",")}
    for name, prompts in workloads.items():
        lengths = [len(p) for p in prompts]
        print(f"{name}: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens", flush=True)
    overrides = {"num_tokens": args.num_tokens, "ngram_min": args.ngram_min, "ngram_max": args.ngram_max}
    defaults = SpeculativeConfig(method="ngram", **{k: v for k, v in overrides.items() if v is not None})
    print(f"ngram settings: {defaults}", flush=True)
    drafts = {
        "draft-bf16": {"draft_dtype": "bfloat16"},
        "draft-layers": {"draft_num_layers": args.draft_num_layers},
    }
    all_modes: dict[str, SpeculativeConfig | None] = {
        "off": None,
        "ngram": defaults,
        "ngram-all": defaults.model_copy(update={"max_num_seqs": 64}),
        **{
            name: SpeculativeConfig(method="draft", num_tokens=defaults.num_tokens, **fields)  # type: ignore[arg-type]
            for name, fields in drafts.items()
        },
    }
    modes = {name: all_modes[name] for name in args.modes.split(",")}
    assert "off" in modes, "every mode is compared with off"
    speculators = {name: speculator_for(engine, config, checkpoint, spec) for name, spec in modes.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cells: dict[tuple[str, int, str], Cell] = {}
    for round_index in range(args.rounds):
        for workload, prompts in workloads.items():
            for batch in [int(b) for b in args.batches.split(",")]:
                chosen = prompts[: args.batch1_requests] if batch == 1 else prompts
                reference: list[list[int]] | None = None
                order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
                runs: dict[str, Run] = {}
                for mode in order:
                    if mode == "ngram-all" and batch == 1:
                        continue  # the same as ngram below the batch threshold
                    engine.speculator = speculators[mode]
                    runs[mode] = measure(engine, chosen, batch, params, f"{round_index}-{workload}-{batch}-{mode}")
                reference = runs["off"].tokens
                for mode, run in runs.items():
                    cell = cells.setdefault((workload, batch, mode), Cell())
                    cell.tok_s.append(run.num_output / run.elapsed_s)
                    cell.decode_tok_s.append(run.decode_tok_s)
                    cell.robust_tok_s.append(run.robust_decode_tok_s)
                    cell.ttft_s += run.ttft_s
                    cell.proposed += run.proposed
                    cell.accepted += run.accepted
                    cell.verified += run.verified
                    cell.identical.append(run.tokens == reference)
                    print(
                        f"round {round_index + 1} {workload} batch {batch} {mode}: {run.num_output} tokens in "
                        f"{run.elapsed_s:.1f}s = {run.num_output / run.elapsed_s:.1f} tok/s (decode "
                        f"{run.decode_tok_s:.1f}, robust {run.robust_decode_tok_s:.1f}), accepted "
                        f"{run.accepted}/{run.proposed}",
                        flush=True,
                    )
    print()
    header = "| workload | batch | mode | output tok/s | vs off | decode tok/s | vs off | decode tok/s, robust | vs off"
    print(header + " | TTFT p50 ms | acceptance | tokens per verify step | identical to off |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (workload, batch, mode), cell in cells.items():
        off = cells[(workload, batch, "off")]
        tok_s = statistics.median(cell.tok_s)
        decode = statistics.median(cell.decode_tok_s)
        robust = statistics.median(cell.robust_tok_s)
        acceptance = f"{cell.accepted / cell.proposed:.0%}" if cell.proposed else "–"
        per_step = f"{(cell.accepted + cell.verified) / cell.verified:.2f}" if cell.verified else "–"
        print(
            f"| {workload} | {batch} | {mode} | {tok_s:.1f} | {tok_s / statistics.median(off.tok_s):.2f}x | "
            f"{decode:.1f} | {decode / statistics.median(off.decode_tok_s):.2f}x | "
            f"{robust:.1f} | {robust / statistics.median(off.robust_tok_s):.2f}x | "
            f"{statistics.median(cell.ttft_s) * 1000:.0f} | {acceptance} | {per_step} | "
            f"{'yes' if all(cell.identical) else 'no'} |"
        )


def speculator_for(
    engine: LLMEngine, config: EngineConfig, checkpoint: Checkpoint, spec: SpeculativeConfig | None
) -> Speculator | None:
    """The mode's speculator for the one engine; a draft mode builds its draft model (and KV cache) once."""
    if spec is None or spec.method != "draft":
        return build_speculator(spec) if spec is not None else None
    options = config.model_copy(update={"speculative": spec})
    draft = DraftProposer.build(options, engine.model_config, engine.capacity, checkpoint.state_dict, checkpoint.blocks)
    return build_speculator(spec, draft)


if __name__ == "__main__":
    main()
