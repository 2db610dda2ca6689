"""KV cache dtypes on the CPU: decode attention over an int8 cache against a float32 one, and what fits in a budget.

    python benchmarks/kv_dtype.py [--seqs 32] [--context 800] [--layers 8] [--budget-mib 256]

Decode attention: one decode step of the bundled SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head
dim 64, block size 16) for `--seqs` sequences of `--context` tokens each, over `--layers` layer caches (blocks
shuffled, as after hours of serving; the caches far larger than the last-level cache, so every step reads them from
memory), through the native C kernel (`kernels/cpu/kernels.c`) and the torch path, with the cache in float32 and
in int8 (the float32 values quantized by `store_kv`). Prints milliseconds per step, the cache bytes read per step
over that time, the speed-up of int8 over float32 and how far int8's output lies from float32's.

Capacity: tokens and 2048-token sequences that fit in `--budget-mib` of KV for the bundled model's shape (30
layers, 3 KV heads, head dim 64) per KV dtype, as the engine plans its cache (`ModelRunner._plan_kv_cache`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_engine.config import KVCapacity, ModelConfig
from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers import torch_ops
from local_engine.model_runner import advise_huge_pages

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}


def make_caches(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """q, the float32 cache [2, layers, blocks, 16, 3, 64], the int8 one and its scales, block tables, lengths."""
    generator = torch.Generator().manual_seed(0)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    per_seq = -(-args.context // BLOCK_SIZE)
    num_blocks = args.seqs * per_seq + 64
    tables = torch.randperm(num_blocks, generator=generator)[: args.seqs * per_seq].view(args.seqs, per_seq)
    tables = tables.to(torch.int32).contiguous()
    shape = (2, args.layers, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.empty(shape)
    advise_huge_pages(cache)
    cache.normal_(generator=generator)
    cache8 = torch.empty(shape, dtype=torch.int8)
    advise_huge_pages(cache8)
    cache8.zero_()
    scales = torch.zeros(2, args.layers, num_blocks, NUM_KV_HEADS)
    positions = torch.arange(args.context)
    for seq in range(args.seqs):  # each sequence written as one prefill would write it
        slots = tables[seq].long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        for layer in range(args.layers):
            k = cache[0, layer].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
            v = cache[1, layer].view(-1, NUM_KV_HEADS, HEAD_DIM)[slots]
            caches = (cache8[0, layer], cache8[1, layer], slots, scales[0, layer], scales[1, layer])
            assert cpu_kernels.store_kv(k, v, *caches[:3], *caches[3:])
    q = torch.randn(args.seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    return q, cache, cache8, scales, tables, lens


def time_step(
    attend: object, q: torch.Tensor, layers: list[tuple[torch.Tensor, ...]], rest: tuple[object, ...]
) -> float:
    """Best of five: milliseconds for one step (every layer once)."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for k_cache, v_cache, *scales in layers:
            attend(q, k_cache, v_cache, *rest, *scales)  # type: ignore[operator]
        best = min(best, time.perf_counter() - started)
    return best * 1000


def attention(args: argparse.Namespace) -> None:
    q, cache, cache8, scales, tables, lens = make_caches(args)
    rest = (tables, lens, HEAD_DIM**-0.5)
    f32 = [(cache[0, i], cache[1, i]) for i in range(args.layers)]
    i8 = [(cache8[0, i], cache8[1, i], scales[0, i], scales[1, i]) for i in range(args.layers)]
    exact = cpu_kernels.paged_decode_attention(q, *f32[0], *rest)
    quantized = cpu_kernels.paged_decode_attention(q, *i8[0][:2], *rest, *i8[0][2:])
    assert exact is not None and quantized is not None
    tokens = args.seqs * args.context * args.layers
    element_bytes = {"float32": 4 * 2 * NUM_KV_HEADS * HEAD_DIM, "int8": 2 * NUM_KV_HEADS * HEAD_DIM}
    print(f"\n| {'variant':<22} | ms / step | MiB read | GB/s |")
    print(f"|{'-' * 24}|-----------|----------|------|")
    timings = {}
    for name, attend, layers in (
        ("C kernel, float32", cpu_kernels.paged_decode_attention, f32),
        ("C kernel, int8", cpu_kernels.paged_decode_attention, i8),
        ("torch path, float32", torch_ops.paged_decode_attention, f32),
        ("torch path, int8", torch_ops.paged_decode_attention, i8),
    ):
        ms = time_step(attend, q, layers, rest)
        timings[name] = ms
        read = tokens * element_bytes["int8" if "int8" in name else "float32"]
        print(f"| {name:<22} | {ms:9.2f} | {read / 2**20:8.0f} | {read / ms / 1e6:4.1f} |")
    print(
        f"\nint8 over float32, C kernel: {timings['C kernel, float32'] / timings['C kernel, int8']:.2f}x faster; "
        f"torch path: {timings['torch path, float32'] / timings['torch path, int8']:.2f}x"
    )
    print(f"int8 output vs float32 output: max |diff| {(quantized - exact).abs().max().item():.4f}, mean "
          f"{(quantized - exact).abs().mean().item():.5f} (outputs' std {exact.std().item():.3f})")  # fmt: skip


def capacity(budget_mib: int) -> None:
    model = ModelConfig.from_hf_config(SMOLLM2_135M)
    budget = budget_mib * 2**20
    print(f"\nKV capacity in {budget_mib} MiB, SmolLM2-135M (30 layers, 3 KV heads, head dim 64), block size 16:")
    print("\n| KV dtype | bytes / token | tokens | 2048-token sequences | vs float32 |")
    print("|----------|---------------|--------|----------------------|------------|")
    base = None
    for dtype in ("float32", "bfloat16", "float16", "int8"):
        per_token = model.kv_bytes_per_token(dtype)
        scales = model.kv_scale_bytes_per_block(dtype)
        kv = KVCapacity(budget // (per_token * BLOCK_SIZE + scales), BLOCK_SIZE, per_token, dtype, scales)
        base = base or kv.num_tokens
        print(
            f"| {dtype:<8} | {kv.num_bytes / kv.num_tokens:13.1f} | {kv.num_tokens:6,} | "
            f"{kv.max_concurrent_seqs(2048):20} | {kv.num_tokens / base:9.2f}x |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=800)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=256)
    args = parser.parse_args()
    if not cpu_kernels.is_available():
        print("the native CPU kernels are not available here (see the warning above)", file=sys.stderr)
        return 2
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if os.path.exists("/proc/loadavg") else "n/a"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load}")
    print(f"decode attention: {args.seqs} sequences x {args.context} tokens, {args.layers} layers")
    attention(args)
    capacity(args.budget_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
