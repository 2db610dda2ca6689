"""CUDA graphs for decode steps: the forward pass of a pure-decode batch replayed from a graph captured at start-up.

A decode step of a small model launches a few hundred kernels whose launch overhead (Python + driver) is larger
than their GPU time; a graph replays all of them with one launch. Graphs need fixed shapes and fixed addresses,
so the runner owns static input buffers sized for the largest captured batch, captures one graph per batch size
in `capture_sizes` (1, 2, 4, 8, then every 8 up to `max_num_seqs`, at most 256, like vLLM), and pads a batch to
the next captured size. Padding rows write no KV (slot -1) and attend over one token of block 0 (finite garbage
that is never read back). Block tables are padded to the model's full length, so the decode kernel's split count
(chosen from that width) is the same at capture and at replay. Prefill and mixed steps run eagerly.

Only the Triton backend can be captured: the torch ops read sequence lengths back to the host. On CPU the same
padding code runs with `capture=False` (each "replay" is an eager call on the static buffers), which is how the
tests check the padding without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from local_engine.layers.attention import AttentionMetadata

__all__ = ["DecodeGraphs", "capture_sizes", "padded_size"]

logger = logging.getLogger("unigate.engine")

MAX_CAPTURE_SIZE = 256

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to min(max_num_seqs, 256), always including the top."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [n for n in (1, 2, 4) if n < top] + list(range(8, top + 1, 8))
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sorted(set(sizes))


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs`; None when the batch is larger than any graph."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


class DecodeGraphs:
    """Static buffers plus one graph (or, with `capture=False`, one eager call) per batch size."""

    def __init__(
        self,
        forward: Forward,
        *,
        sizes: list[int],
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.forward = forward
        self.sizes = sizes
        self.device = device
        self.is_captured = capture
        max_size = sizes[-1]
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_size, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
            prefill_max_seqlen_q=0,
        )

    def _run_static(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._meta(size))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory from the pool
            self._run_static(size)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._run_static(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            time.perf_counter() - started,
        )

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A pure-decode batch (one token per sequence) no larger than the largest graph."""
        return meta.num_decode_tokens == num_tokens and 0 < num_tokens <= self.max_size

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] of a pure-decode batch of B sequences, through the graph of the next size."""
        num_seqs = input_ids.shape[0]
        size = padded_size(num_seqs, self.sizes)
        assert size is not None and meta.decode_block_tables is not None and meta.decode_context_lens is not None
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping, non_blocking=True)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:num_seqs, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:num_seqs].copy_(meta.decode_context_lens, non_blocking=True)
        if num_seqs < size:  # padding rows: no KV write, one finite token of attention, outputs dropped
            self.slot_mapping[num_seqs:size].fill_(-1)
            self.context_lens[num_seqs:size].fill_(1)
            self.block_tables[num_seqs:size, 0].fill_(0)
        if self.is_captured:
            self.graphs[size].replay()
            return self.outputs[size][:num_seqs]
        return self._run_static(size)[:num_seqs]
