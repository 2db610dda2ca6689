"""Decode attention on the CPU: the native kernel (`local_engine/kernels/cpu/kernels.c`) against the torch path.

    python benchmarks/cpu_attention.py [--seqs 24] [--min-len 100] [--max-len 800] [--layers 30]

One decode step of the bundled SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64, block size 16):
`--seqs` sequences with contexts uniform in [min-len, max-len), one paged cache per layer in one tensor, allocated
as the engine allocates it (huge pages advised). Prints milliseconds per step (all layers) and the KV bytes read
per step over that time for:

- the torch path (`torch_ops.paged_decode_attention`: gather the blocks, then SDPA) and the C kernel;
- the kernel with block tables shuffled (blocks scattered over the cache, as after hours of serving) and in
  order (each sequence's blocks adjacent), both reading the whole cache from memory;
- the kernel on one layer's cache reused for every layer ("hot": it stays in the last-level cache unless other
  tenants of the machine evict it);
- the kernel with every table pointing at four blocks ("in L1/L2": 48 KiB of KV), which bounds its arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers import torch_ops
from local_engine.model_runner import advise_huge_pages

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16

Attention = Callable[..., torch.Tensor | None]


def make_step(args: argparse.Namespace, shuffled: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    lens = torch.randint(args.min_len, args.max_len, (args.seqs,), generator=generator)
    lens = lens.sort(descending=True).values.to(torch.int32)  # the scheduler orders decodes longest first
    blocks = [-(-int(n) // BLOCK_SIZE) for n in lens]
    num_blocks = 3 * sum(blocks)  # the cache is larger than what this step reads, as in the engine
    ids = torch.randperm(num_blocks, generator=generator) if shuffled else torch.arange(num_blocks)
    tables = torch.zeros(args.seqs, max(blocks), dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks):
        tables[seq, :n] = ids[start : start + n]
        start += n
    # Allocated as the engine allocates its CPU cache: huge pages advised before the first touch.
    cache = torch.empty(2, args.layers, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    advise_huge_pages(cache)
    cache.normal_(generator=generator)
    q = torch.randn(args.seqs, NUM_HEADS, HEAD_DIM, generator=generator)
    return q, cache, tables, lens


def time_step(
    attend: Attention, q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], *rest: object
) -> float:
    """Best of three: milliseconds for one step (every layer once)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for k_cache, v_cache in caches:
            attend(q, k_cache, v_cache, *rest)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seqs", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=800)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    if not cpu_kernels.is_available():
        print("the native CPU kernels are not available here (see the warning above)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.seqs} sequences, {args.layers} layers")
    print(f"\n| {'variant':<34} | ms / step | GB/s of KV |")
    print(f"|{'-' * 36}|-----------|------------|")
    for shuffled in (True, False):
        q, cache, tables, lens = make_step(args, shuffled)
        caches = [(cache[0, i], cache[1, i]) for i in range(args.layers)]
        kv_bytes = int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 4 * 2 * args.layers
        rest = (tables, lens, HEAD_DIM**-0.5)
        expected = torch_ops.paged_decode_attention(q, *caches[0], *rest)
        got = cpu_kernels.paged_decode_attention(q, *caches[0], *rest)
        assert got is not None and torch.allclose(got, expected, rtol=1e-5, atol=2e-6), "kernel and torch disagree"
        order = "shuffled" if shuffled else "in order"
        variants: list[tuple[str, Attention, list[tuple[torch.Tensor, torch.Tensor]], tuple[object, ...]]] = [
            (f"torch path, blocks {order}", torch_ops.paged_decode_attention, caches, rest),
            (f"C kernel, blocks {order}", cpu_kernels.paged_decode_attention, caches, rest),
        ]
        if shuffled:
            variants.append(
                (
                    "C kernel, one layer's cache (hot)",
                    cpu_kernels.paged_decode_attention,
                    caches[:1] * args.layers,
                    rest,
                )
            )
            four_blocks = (tables.remainder(4).to(torch.int32), *rest[1:])
            variants.append(("C kernel, 4 blocks (in L1/L2)", cpu_kernels.paged_decode_attention, caches, four_blocks))
        for name, attend, layer_caches, step_rest in variants:
            ms = time_step(attend, q, layer_caches, *step_rest)
            print(f"| {name:<34} | {ms:9.1f} | {kv_bytes / ms / 1e6:10.1f} |")
    print(f"\nKV read per step: {kv_bytes / 2**20:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
