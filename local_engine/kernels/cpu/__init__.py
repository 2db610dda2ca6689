"""Native CPU kernels for the local engine (`kernels.c`), float32, next to the Triton kernels of the parent package:

- paged decode attention reading the KV cache blocks in place, where the torch path copies every sequence's
  blocks out of the cache first (`torch_ops._gather`) and runs SDPA with a query length of one GQA group, which
  the CPU kernels handle poorly;
- paged prefill attention (causal, chunked prefill and cached prefixes included), flash-attention style on the
  CPU: each sequence's keys copied once per KV head, transposed, so that scores are register-tiled outer products
  (no horizontal sums), values read in place from the cache; torch's flash SDPA path gathers each sequence's
  blocks first and runs at about 60% of its speed here;
- rotary embedding on q and k in place, one pass instead of a dozen small torch ops per layer;
- projections on weights packed once into panels (`pack_linear_weight`) for decode batches and small prefill
  chunks: a stream of the weight at read bandwidth for a few rows and at the FMA units' rate for dozens, where
  oneDNN's and MKL's small-M paths reach about half of either (`layers/linear.py` calls it up to
  `linear.NATIVE_MAX_ROWS` rows). The panels may also hold a GGUF checkpoint's own Q4_1 or Q8_0 blocks
  (`pack_block_weight`), dequantized on the fly (in registers for a few rows, a chunk at a time in L1 beyond)
  to exactly the float32 weights the checkpoint dequantizes to: the same result bit for bit, from 5-6x fewer
  bytes streamed per decode step;
- RMSNorm with its residual add, silu-and-mul and the KV cache write, one pass over the data each, where the
  torch ops take several (and a fresh tensor per step) for each;
- the whole decoder stack of a decode step in one call (`DecoderWeights`, `Kernel.decode_layers`: the kernels
  above in one OpenMP region, used by `local_engine/cpu_decode.py`).

Modules: `library` builds the C source with the machine's compiler on first use, loads it with ctypes and declares
its signatures (once, in `SIGNATURES`); `launch` holds the torch-facing launchers, which return None (False for
the in-place ones) where the kernels cannot be built or a call is outside what they handle; `cpu_ops` is the six
engine operations on the launchers with the torch ops as fallback (an `Ops`, chosen by `layers.select_ops`).
Importing this package never imports triton: the CPU path does not need it.
"""

from __future__ import annotations

from local_engine.kernels.cpu.launch import (
    BLOCK_FORMATS,
    WEIGHTS_F32,
    WEIGHTS_Q4_1,
    WEIGHTS_Q8_0,
    apply_rotary,
    linear,
    pack_block_weight,
    pack_linear_weight,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    silu_and_mul,
    store_kv,
    unpack_block_weight,
)
from local_engine.kernels.cpu.library import DecoderWeights, Kernel, is_available, load

__all__ = [
    "BLOCK_FORMATS",
    "WEIGHTS_F32",
    "WEIGHTS_Q4_1",
    "WEIGHTS_Q8_0",
    "DecoderWeights",
    "Kernel",
    "apply_rotary",
    "is_available",
    "linear",
    "load",
    "pack_block_weight",
    "pack_linear_weight",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "unpack_block_weight",
]
