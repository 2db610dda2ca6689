"""Quantization and KV memory on the bundled SmolLM2-135M-Instruct: the guides' table, measured in one run.

    python benchmarks/quantization.py                      # the issue's sizes (tens of minutes on 2 cores)
    python benchmarks/quantization.py --smoke              # tiny sizes: every row, seconds each
    python benchmarks/quantization.py --weights int4,gguf --kv model --llama-cpp-python /tmp/llamacpp-venv/bin/python

One row per weights setting × KV cache dtype:
- weights: float32 (the GGUF dequantized, float32 panels); bfloat16; int8 and int4 (`UNIGATE_ENGINE__QUANTIZATION`,
  quantized at load time from float32); gguf (float32 with the decode projections on the file's own Q4_1/Q8_0
  blocks, `cpu_gguf_blocks`, the CPU default for a GGUF);
- KV: model (the model dtype), bfloat16, int8 (`UNIGATE_ENGINE__KV_CACHE_DTYPE`).
Columns: weight MiB (what the engine holds, packed copies included); KV bytes per token (int8 scales included);
tokens that fit in a 256 MiB KV budget; perplexity on the evaluation text (`local_engine/perplexity.py`) and its
change against float32; greedy agreement with float32: mean tokens until the first divergence over N prompts
(slices of the evaluation text) of M new tokens; batch-1 TTFT (200-token prompt) and decode tok/s; the mixed
workload of `benchmarks/engine_throughput.py` (N requests, prompts of 32-600 tokens, outputs of 16-256) in
generated tok/s. Ratios are against the float32 row of the same run (machine speed swings over minutes).

`--prequantized DIR[,DIR]` adds a row per pre-quantized checkpoint of the bundled model (GPTQ, AWQ or auto-round,
`local_engine/prequantized.py`: same tokenizer, so its perplexity compares), served with its own weights; the row
is named by the checkpoint's format (e.g. `gptq int4 g128`).

`--llama-cpp-python PY` also measures llama.cpp (the `llama-cpp-python` package installed for interpreter PY, in
its own environment: it is no dependency of this project) decoding the same GGUF at batch 1 with the same number
of threads and the same prompt, in a subprocess of this run, and prints the int4 and gguf rows' decode speed as a
ratio of it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_throughput import engine_batch1, greedy, make_workload, run_engine

from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.loader import bundled_model_path, load_checkpoint
from local_engine.perplexity import evaluation_text, perplexity

WEIGHTS = ("float32", "bfloat16", "int8", "int4", "gguf")
KV = ("model", "bfloat16", "int8")
BUDGET = 256 * 2**20  # the fixed KV budget of the "tokens in 256 MiB" column


@dataclass
class Sizes:
    ppl_tokens: int
    ppl_window: int
    num_prompts: int
    prompt_len: int
    new_tokens: int
    batch1_prompt: int
    batch1_new: int
    mixed_requests: int
    mixed_prompt: tuple[int, int]
    mixed_output: tuple[int, int]
    kv_cache_memory: int


@dataclass
class Row:
    weights: str
    kv: str
    note: str = ""  # "n/a (setting missing)", an error, or "= ..." for a duplicate
    weight_bytes: int = 0
    kv_bytes_per_token: float = 0.0
    tokens_in_budget: int = 0
    ppl: float = 0.0
    agreement: float = 0.0
    ttft_s: float = 0.0
    decode_tps: float = 0.0
    mixed_tps: float = 0.0


def missing_setting(weights: str, kv: str) -> str | None:
    """The EngineConfig field a row needs that this tree does not have yet."""
    if weights in ("int8", "int4") and "quantization" not in EngineConfig.model_fields:
        return "quantization"
    if kv != "model" and "kv_cache_dtype" not in EngineConfig.model_fields:
        return "kv_cache_dtype"
    return None


def load_weights(weights: str, cache_dir: Path) -> Any:
    """The bundled checkpoint as the `weights` row serves it (read once per row group: every KV dtype shares it)."""
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    load: dict[str, Any] = {"quantization": weights} if weights in ("int8", "int4") else {}
    return load_checkpoint(bundled_model_path(), cache_dir=cache_dir, dtype=dtype, **load)


def build_engine(checkpoint: Any, weights: str, kv: str, sizes: Sizes) -> LLMEngine:
    """`weights` is a row of WEIGHTS, or a pre-quantized checkpoint's row (served with its own weights)."""
    options: dict[str, Any] = {
        "device": "cpu",
        "dtype": "bfloat16" if weights == "bfloat16" else "float32",
        "kv_cache_memory": sizes.kv_cache_memory,
        "max_num_seqs": 64,
        "cpu_gguf_blocks": weights == "gguf",
    }
    if weights in ("int8", "int4"):
        options["quantization"] = weights
    if kv != "model":
        options["kv_cache_dtype"] = kv
    return LLMEngine.from_checkpoint(checkpoint, EngineConfig(**options))


def load_prequantized(directories: str, bundled: Any) -> dict[str, Any]:
    """{row name (the checkpoint's format): checkpoint} for `--prequantized`; each must be of the bundled model."""
    rows = {}
    for directory in (Path(p) for p in directories.split(",") if p):
        loaded = load_checkpoint(directory, dtype=torch.float32)
        declared = loaded.hf_config.get("unigate_quantization", {}).get("checkpoint")
        if declared is None or loaded.hf_config["vocab_size"] != bundled.hf_config["vocab_size"]:
            raise SystemExit(f"{directory}: not a pre-quantized checkpoint of the bundled model")
        rows[declared] = loaded
    return rows


def tokens_until_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def measure(engine: LLMEngine, row: Row, text: list[int], sizes: Sizes, reference: list[list[int]] | None) -> list:
    """Fill `row` from `engine`; returns the greedy outputs (the float32 row's are the reference of the others)."""
    capacity = engine.capacity
    row.weight_bytes = engine.runner.weights_bytes
    row.kv_bytes_per_token = capacity.num_bytes / capacity.num_tokens
    per_block = capacity.bytes_per_token * capacity.block_size + capacity.scale_bytes_per_block
    row.tokens_in_budget = BUDGET // per_block * capacity.block_size
    row.ppl = perplexity(engine, text[: sizes.ppl_tokens], window=sizes.ppl_window).value
    step = max(1, (len(text) - sizes.prompt_len) // sizes.num_prompts)
    prompts = [text[i * step : i * step + sizes.prompt_len] for i in range(sizes.num_prompts)]
    outputs = [c[0].token_ids for c in engine.generate(prompts, greedy(sizes.new_tokens))]
    ref = reference if reference is not None else outputs
    row.agreement = statistics.fmean(tokens_until_divergence(o, r) for o, r in zip(outputs, ref, strict=True))
    vocab = engine.model_config.vocab_size
    batch1_prompt = make_workload(1, (sizes.batch1_prompt,) * 2, (1, 1), vocab, seed=99)[0].prompt
    engine.generate([batch1_prompt[:16]], greedy(2))  # warm-up
    row.ttft_s, row.decode_tps = engine_batch1(engine, batch1_prompt, sizes.batch1_new)
    if sizes.mixed_requests:
        requests = make_workload(sizes.mixed_requests, sizes.mixed_prompt, sizes.mixed_output, vocab)
        row.mixed_tps = run_engine(engine, requests).tokens_per_s
    return outputs


LLAMA_CPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["model"], n_ctx=args["n_ctx"], n_threads=args["threads"],
            n_threads_batch=args["threads"], n_batch=512, verbose=False, logits_all=False)
def run(prompt, num_new):
    llm.reset()
    started = time.perf_counter()
    times = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) == num_new:
            break
    return times[0] - started, (num_new - 1) / (times[-1] - times[0])
run(args["prompt"][:16], 2)  # warm-up
ttft, tps = run(args["prompt"], args["num_new"])
print(json.dumps({"ttft_s": ttft, "decode_tps": tps}))
"""


def llama_cpp_batch1(python: str, prompt: list[int], num_new: int) -> dict[str, float]:
    """llama.cpp's batch-1 TTFT and decode tok/s on the bundled GGUF, same threads and prompt, in a subprocess."""
    args = {
        "model": str(bundled_model_path()),
        "n_ctx": len(prompt) + num_new + 16,
        "threads": torch.get_num_threads(),
        "prompt": prompt,
        "num_new": num_new,
    }
    result = subprocess.run(
        [python, "-c", LLAMA_CPP_SCRIPT, json.dumps(args)], capture_output=True, text=True, timeout=600, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def fmt_row(row: Row, base: Row | None, sizes: Sizes) -> str:
    name = f"{row.weights} / KV {row.kv}"
    if row.note:
        return f"| {name:24} | {row.note} |"
    ppl_change = f"{100 * (row.ppl / base.ppl - 1):+.2f}%" if base else "-"
    mixed = f"{row.mixed_tps:.1f}"
    if not sizes.mixed_requests:
        mixed = "-"
    elif base:
        mixed += f" ({row.mixed_tps / base.mixed_tps:.2f}x)"
    decode = f"{row.decode_tps:.1f} ({row.decode_tps / base.decode_tps:.2f}x)" if base else f"{row.decode_tps:.1f}"
    return (
        f"| {name:24} | {row.weight_bytes / 2**20:8.1f} | {row.kv_bytes_per_token:8.0f} | {row.tokens_in_budget:7d} "
        f"| {row.ppl:8.3f} | {ppl_change:>8} | {row.agreement:5.1f} / {sizes.new_tokens} | {row.ttft_s * 1000:6.0f} "
        f"| {decode:>14} | {mixed:>14} |"
    )


HEADER = (
    "| weights / KV             | weight MiB | KV B/token | tokens in 256 MiB | perplexity | vs float32 "
    "| greedy agreement | TTFT ms | decode tok/s (vs f32) | mixed tok/s (vs f32) |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiniest sizes (a test runs it)")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help=f"rows to run, of {','.join(WEIGHTS)}")
    parser.add_argument("--kv", default=",".join(KV), help=f"KV cache dtypes to run, of {','.join(KV)}")
    parser.add_argument(
        "--prequantized",
        default="",
        help="comma-separated directories of pre-quantized (GPTQ / AWQ / auto-round) checkpoints of the bundled "
        "model: a row each, after the others",
    )
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="evaluation text tokens scored")
    parser.add_argument("--ppl-window", type=int, default=1024, help="perplexity window (stride: half of it)")
    parser.add_argument("--prompts", type=int, default=32, help="greedy agreement: prompts")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy agreement: new tokens per prompt")
    parser.add_argument("--batch1-new", type=int, default=128, help="batch-1 decode: new tokens")
    parser.add_argument("--mixed-requests", type=int, default=32, help="mixed workload: requests (0: skip)")
    parser.add_argument("--cache-dir", type=Path, default=Path(".unigate/models"))
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch (and OpenMP) threads, llama.cpp's too; default torch's. On a host loaded past its cores, 1 avoids "
        "OpenMP barriers waiting on descheduled threads (3x the wall time of 2 threads in the smoke run at load 12)",
    )
    parser.add_argument("--llama-cpp-python", default=None, help="a python with llama-cpp-python installed")
    return parser.parse_args()


def sizes_of(args: argparse.Namespace) -> Sizes:
    if args.smoke:
        return Sizes(48, 32, 2, 16, 4, 16, 4, 2, (8, 24), (2, 4), 16 * 2**20)
    return Sizes(
        args.ppl_tokens,
        args.ppl_window,
        args.prompts,
        32,
        args.new_tokens,
        200,
        args.batch1_new,
        args.mixed_requests,
        (32, 600),
        (16, 256),
        2 * 2**30,
    )


def main() -> None:
    args = parse_args()
    sizes = sizes_of(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    weights_rows = [w for w in args.weights.split(",") if w]
    kv_rows = [k for k in args.kv.split(",") if k]
    unknown = set(weights_rows) - set(WEIGHTS) | set(kv_rows) - set(KV)
    if unknown:
        raise SystemExit(f"unknown rows: {sorted(unknown)}")
    torch.manual_seed(0)
    started = time.perf_counter()
    checkpoints = {"float32": load_weights("float32", args.cache_dir)}  # the tokenizer's, and the first row's
    tokenizer = checkpoints["float32"].tokenizer
    text = tokenizer.encode(evaluation_text())
    print(
        f"bundled model, threads={torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; evaluation text "
        f"{len(text)} tokens, perplexity over the first {sizes.ppl_tokens} (window {sizes.ppl_window}); greedy "
        f"agreement over {sizes.num_prompts} prompts x {sizes.new_tokens} tokens; batch-1 {sizes.batch1_prompt}-token "
        f"prompt, {sizes.batch1_new} new; mixed workload {sizes.mixed_requests} requests"
    )
    rows: list[Row] = []
    reference: list[list[int]] | None = None
    base: Row | None = None
    prequantized = load_prequantized(args.prequantized, checkpoints["float32"])
    for weights in [*weights_rows, *prequantized]:
        checkpoint = prequantized.get(weights)
        for kv in kv_rows:
            row = Row(weights, kv)
            rows.append(row)
            missing = missing_setting(weights, kv)
            if missing is not None:
                row.note = f"n/a (setting missing: {missing})"
                continue
            if weights == "bfloat16" and kv == "bfloat16" and "model" in kv_rows:
                row.note = "= bfloat16 / KV model (the model dtype is bfloat16)"
                continue
            if checkpoint is None:
                key = "float32" if weights == "gguf" else weights  # the same float32 weights, blocks kept
                checkpoint = checkpoints.get(key) or checkpoints.setdefault(key, load_weights(key, args.cache_dir))
            engine = build_engine(checkpoint, weights, kv, sizes)
            try:
                outputs = measure(engine, row, text, sizes, reference)
            finally:
                del engine
                gc.collect()
            if weights == "float32" and kv == "model":
                reference, base = outputs, row
            elapsed, load = time.perf_counter() - started, os.getloadavg()[0]
            print(f"  measured ({elapsed:.0f} s, load {load:.2f}): {fmt_row(row, base, sizes)}", flush=True)
    print()
    print(HEADER)
    for row in rows:
        print(fmt_row(row, base, sizes))
    if args.llama_cpp_python:
        vocab = int(tokenizer.vocab_size)
        prompt = make_workload(1, (sizes.batch1_prompt,) * 2, (1, 1), vocab, seed=99)[0].prompt
        theirs = llama_cpp_batch1(args.llama_cpp_python, prompt, sizes.batch1_new)
        print(
            f"\nllama.cpp (llama-cpp-python), same GGUF, threads={torch.get_num_threads()}, batch 1: TTFT "
            f"{theirs['ttft_s'] * 1000:.0f} ms, decode {theirs['decode_tps']:.1f} tok/s"
        )
        for row in rows:
            if row.weights in ("int4", "gguf") and row.kv == "model" and not row.note:
                print(f"  {row.weights} / KV model decode vs llama.cpp: {row.decode_tps / theirs['decode_tps']:.2f}x")
    print(f"\ndone in {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
