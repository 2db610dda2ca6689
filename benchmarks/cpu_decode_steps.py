"""Decode step time by batch size on the CPU, the bundled model's float32 weights in float32 panels against the
GGUF file's own Q4_1 / Q8_0 blocks (`UNIGATE_ENGINE__CPU_GGUF_BLOCKS`, `layers/linear.py`).

    python benchmarks/cpu_decode_steps.py [--batches 1,4,8,16,24,32] [--prompt 300] [--rounds 2]

For each batch size: that many requests with `--prompt`-token prompts are prefilled, then 20 decode steps are
timed (the whole engine step: the native decoder, logits, sampling, scheduling). Both engines run in one process,
alternating, and the best round is printed: milliseconds per step, and the time per step of the blocks engine over
the float32 one. The two produce the same tokens (tests/local_engine/test_gguf_block_panels.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.loader import bundled_model_path, load_checkpoint
from local_engine.sampling_params import SamplingParams

DECODE_STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,8,16,24,32")
    parser.add_argument("--prompt", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(".unigate/models"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    checkpoint = load_checkpoint(bundled_model_path(), cache_dir=args.cache_dir, dtype=torch.float32)
    engines = {}
    for blocks in (False, True):
        config = EngineConfig(
            device="cpu", dtype="float32", kv_cache_memory=2 * 2**30, max_num_seqs=96, cpu_gguf_blocks=blocks
        )
        engines[blocks] = LLMEngine.from_checkpoint(checkpoint, config)
    print(f"threads={torch.get_num_threads()}, GGUF blocks: {engines[True].stats()['gguf_block_panels']}")
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 4, min_tokens=DECODE_STEPS + 4, ignore_eos=True)
    best: dict[tuple[int, bool], float] = {}
    generator = torch.Generator().manual_seed(0)
    for round_ in range(args.rounds):
        for batch in batches:
            for blocks, engine in engines.items():
                for i in range(batch):
                    prompt = torch.randint(200, 49152, (args.prompt,), generator=generator).tolist()
                    engine.add_request(f"{round_}-{batch}-{i}", prompt, params)
                while engine.scheduler.waiting or any(
                    s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
                ):
                    engine.step()  # prefill (with the first decodes)
                started = time.perf_counter()
                for _ in range(DECODE_STEPS):
                    engine.step()
                elapsed = (time.perf_counter() - started) / DECODE_STEPS
                best[(batch, blocks)] = min(best.get((batch, blocks), float("inf")), elapsed)
                while engine.has_unfinished_requests:
                    engine.step()
    print(f"{'batch':>5} {'float32 panels ms':>18} {'GGUF blocks ms':>15} {'ratio':>6}")
    for batch in batches:
        plain, blocks = best[(batch, False)], best[(batch, True)]
        print(f"{batch:5d} {plain * 1e3:18.1f} {blocks * 1e3:15.1f} {blocks / plain:6.2f}")


if __name__ == "__main__":
    main()
