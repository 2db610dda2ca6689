"""Turns a scheduled batch into one forward pass: packs tokens, builds slot mappings and block tables, owns the
model weights and the paged KV cache, and returns the logits of the sequences that sample this step."""

from __future__ import annotations

import ctypes
import itertools
import logging
import sys
import time
from collections.abc import Mapping

import numpy as np
import torch

from local_engine.config import EngineConfig, KVCapacity, ModelConfig
from local_engine.cpu_decode import CpuDecoder
from local_engine.cuda_graphs import DecodeGraphs, capture_sizes
from local_engine.errors import ModelLoadError
from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.attention import Attention, AttentionMetadata
from local_engine.layers.backend import Ops, select_ops
from local_engine.layers.linear import (
    NATIVE_MAX_ROWS,
    PackedLinear,
    attach_block_panels,
    attach_quantized_linears,
    is_packing_available,
    pack_linears,
)
from local_engine.layers.rotary import build_cos_sin_cache
from local_engine.models.llama import PACKED_MODULES, LlamaForCausalLM
from local_engine.scheduler import ScheduledBatch

__all__ = ["ModelRunner", "kv_cache_budget"]

logger = logging.getLogger("unigate.engine")

_MADV_HUGEPAGE = 14  # <linux/mman.h>
_HUGE_PAGE = 2 << 20

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def _is_triton_available() -> bool:
    try:
        from local_engine.kernels import is_triton_available
    except ImportError:
        return False
    return is_triton_available()


def kv_cache_budget(
    *, total: int, free: int, reserved: int, allocated: int, activations_peak: int, utilization: float
) -> int:
    """KV cache bytes on a GPU: `utilization` of its memory, minus what others (and the CUDA context) hold
    (`total - free - reserved`), what this process keeps allocated (weights), and the activation peak of a step.
    Memory torch reserved but does not use counts as available."""
    others = max(total - free - reserved, 0)
    return int(total * utilization) - others - allocated - activations_peak


def _block_table_array(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int32 array `[len(tables), longest]`, zero-padded (entries past a context are never
    read), filled in C rather than row by row."""
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if len(tables) else 0
    out = np.zeros((len(tables), width), dtype=np.int32)
    if width:
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
        out[np.arange(width)[None, :] < lengths[:, None]] = flat
    return out


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with transparent huge pages (`madvise(MADV_HUGEPAGE)` on its 2 MiB
    aligned interior). Decode attention reads KV blocks scattered over the whole cache: with 4 KiB pages most
    block reads miss the TLB, and prefetches that miss it do little. False where the call is unavailable or
    refused (nothing changes then; THP set to `never` also leaves 4 KiB pages)."""
    if sys.platform != "linux":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return bool(libc.madvise(first, last - first, _MADV_HUGEPAGE) == 0)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        state_dict: dict[str, torch.Tensor],
        block_weights: Mapping[str, tuple[str, np.ndarray]] | None = None,
    ) -> None:
        started = time.perf_counter()
        self.model_config = model_config
        self.engine_config = engine_config
        self.device = torch.device(engine_config.resolved_device(torch.cuda.is_available()))
        self.dtype_name = engine_config.resolved_dtype(self.device.type)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        self.attention_backend = engine_config.resolved_attention_backend(self.device.type, _is_triton_available())
        self.kv_dtype_name = engine_config.resolved_kv_cache_dtype(self.dtype_name)
        self.kv_dtype = TORCH_DTYPES[self.kv_dtype_name]
        self.block_size = engine_config.block_size
        self.max_model_len = engine_config.resolved_max_model_len(model_config)
        native_cpu = self.device.type == "cpu" and engine_config.cpu_kernels
        if native_cpu and self.dtype != torch.float32:
            # Every native op would hand the call back to torch's; say so once instead of failing over silently.
            logger.info(
                "%s on CPU: the native CPU kernels compute in float32 only, so attention, norms, rotary, "
                "projections and decode steps run on torch's ops (UNIGATE_ENGINE__DTYPE=float32, the CPU default, "
                "uses the native kernels)",
                self.dtype_name,
            )
            native_cpu = False
        ops = select_ops(self.attention_backend, native_cpu=native_cpu)
        self.ops_name = ops.__name__.rsplit(".", 1)[-1]  # torch_ops, cpu_ops or kernels
        self.model = self._build_model(ops, state_dict)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.num_packed_linears = 0
        self.block_panels: dict[str, int] = {}  # GGUF block type -> projections whose decode panels keep it
        if self.device.type == "cpu" and engine_config.pack_cpu_weights and is_packing_available():
            # oneDNN's layout; with the native kernels, few-row calls (decode) read the row-major weight instead
            native_rows = NATIVE_MAX_ROWS if native_cpu and cpu_kernels.is_available() else 0
            self.num_packed_linears = pack_linears(self.model, native_rows)
            if native_rows and block_weights and engine_config.cpu_gguf_blocks and self.dtype == torch.float32:
                self.block_panels = attach_block_panels(
                    self.model, block_weights, PACKED_MODULES, model_config.tie_word_embeddings
                )
        # packed copies beyond the parameters, and quantized weights (`QuantizedLinear`, any device)
        self.weights_bytes += sum(m.extra_bytes for m in self.model.modules() if isinstance(m, PackedLinear))
        self.activations_peak_bytes: int | None = None  # measured by the profiling pass (GPU only)
        self.capacity = self._plan_kv_cache()
        self.kv_cache, self.kv_scales = self._allocate_kv_cache(self.capacity.num_blocks)
        self.graphs = self._build_graphs()
        self.cpu_decoder = self._build_cpu_decoder()
        logger.info(
            "engine ready in %.1fs: %s %s on %s, attention=%s, cuda graphs %s, native CPU decode steps %s%s; "
            "memory: weights %.0f MiB, "
            "activations peak %s, KV cache %s %.0f MiB (%d blocks x %d tokens = %d tokens, %.0f bytes per token, "
            "%d sequences of %d tokens)",
            time.perf_counter() - started,
            model_config.model_type,
            self.dtype_name,
            self.device,
            f"{self.attention_backend} ({self.ops_name})",
            "off" if self.graphs is None else f"for batch sizes up to {self.graphs.max_size}",
            "off" if self.cpu_decoder is None else f"on (up to {self.cpu_decoder.max_rows} sequences)",
            "".join(f", {n} decode projections on the checkpoint's {k} blocks" for k, n in self.block_panels.items()),
            self.weights_bytes / 2**20,
            "not profiled" if self.activations_peak_bytes is None else f"{self.activations_peak_bytes / 2**20:.0f} MiB",
            self.kv_dtype_name,
            self.capacity.num_bytes / 2**20,
            self.capacity.num_blocks,
            self.block_size,
            self.capacity.num_tokens,
            self.capacity.num_bytes / max(self.capacity.num_tokens, 1),
            self.capacity.max_concurrent_seqs(self.max_model_len),
            self.max_model_len,
        )

    def _build_model(self, ops: Ops, state_dict: dict[str, torch.Tensor]) -> LlamaForCausalLM:
        # Built on the meta device so no time goes into random initialisation, then materialised and loaded.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.model_config, ops, max_position=1)
        # Quantized projections (`EngineConfig.quantization`) are swapped in first: they never get a float weight.
        native = self.device.type == "cpu" and self.engine_config.cpu_kernels and self.dtype == torch.float32
        native = native and cpu_kernels.is_available()
        group_size = self.engine_config.quantization_group_size
        state_dict = attach_quantized_linears(model, state_dict, PACKED_MODULES, self.device, group_size, native)
        model = model.to_empty(device=self.device).to(dtype=self.dtype)
        if self.model_config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_weights(state_dict)
        # Rope tables stay float32 whatever the weights' dtype.
        c = self.model_config
        model.cos_sin_cache = build_cos_sin_cache(c.head_dim, self.max_model_len, c.rope_theta, c.rope_scaling).to(
            self.device
        )
        return model.eval()

    # -- KV cache -----------------------------------------------------------------------------------------------

    def _plan_kv_cache(self) -> KVCapacity:
        """Number of blocks from the memory budget: `kv_cache_memory` bytes; else, on a GPU, what
        `gpu_memory_utilization` of it leaves after weights, other users and the activation peak of a profiling
        forward pass at `max_num_batched_tokens`; else the CPU default."""
        bytes_per_token = self.model_config.kv_bytes_per_token(self.kv_dtype_name)
        scale_bytes = self.model_config.kv_scale_bytes_per_block(self.kv_dtype_name)
        budget = self.engine_config.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            self.activations_peak_bytes = self._profile_activations_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_cache_budget(
                total=total,
                free=free,
                reserved=torch.cuda.memory_reserved(self.device),
                allocated=torch.cuda.memory_allocated(self.device),
                activations_peak=self.activations_peak_bytes,
                utilization=self.engine_config.gpu_memory_utilization,
            )
        elif budget is None:
            budget = self.engine_config.cpu_kv_cache_memory
        num_blocks = budget // (bytes_per_token * self.block_size + scale_bytes)
        if num_blocks < 1:
            raise ModelLoadError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.block_size} tokens "
                f"({bytes_per_token} bytes per token): raise kv_cache_memory or gpu_memory_utilization, or lower "
                "max_num_batched_tokens (the activation peak grows with it)"
            )
        return KVCapacity(
            num_blocks=num_blocks,
            block_size=self.block_size,
            bytes_per_token=bytes_per_token,
            kv_dtype=self.kv_dtype_name,
            scale_bytes_per_block=scale_bytes,
        )

    def _profile_activations_peak(self) -> int:
        """Bytes one forward pass at the full batched-token budget allocates on top of the weights (GPU)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        try:
            self.dummy_forward()
        except torch.cuda.OutOfMemoryError as exc:
            raise ModelLoadError(
                f"the profiling forward pass of {self._dummy_num_tokens} tokens ran out of GPU memory: lower "
                "max_num_batched_tokens, or set kv_cache_memory to skip profiling"
            ) from exc
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        num_blocks = -(-self._dummy_num_tokens // self.block_size)
        scratch_bytes = num_blocks * (
            self.block_size * self.model_config.kv_bytes_per_token(self.kv_dtype_name)
            + self.model_config.kv_scale_bytes_per_block(self.kv_dtype_name)
        )
        return max(int(peak) - scratch_bytes, 0)

    @property
    def _dummy_num_tokens(self) -> int:
        return min(self.engine_config.max_num_batched_tokens, self.max_model_len)

    @torch.inference_mode()
    def dummy_forward(self) -> torch.Tensor:
        """One prefill of `max_num_batched_tokens` tokens (capped at the model length) into a scratch KV cache of
        just those blocks, plus the logits of `max_num_seqs` rows: the largest step the scheduler can build.
        Returns the logits; the scratch cache is dropped and whatever cache was attached before is again."""
        num_tokens = self._dummy_num_tokens
        num_blocks = -(-num_tokens // self.block_size)
        attached = [(attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale) for attn in self._attention_layers()]
        self._allocate_kv_cache(num_blocks)
        device = self.device
        meta = AttentionMetadata.one_prefill(num_tokens, self.block_size, device)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        hidden = self.model(input_ids, positions, meta)
        num_rows = min(self.engine_config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_rows]).float()
        for attn, (k_cache, v_cache, k_scale, v_scale) in zip(self._attention_layers(), attached, strict=True):
            # drop the scratch cache, re-attach what was there
            attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = k_cache, v_cache, k_scale, v_scale
        return logits

    def _build_graphs(self) -> DecodeGraphs | None:
        """Decode CUDA graphs on a GPU with the Triton backend, unless `enforce_eager`."""
        if self.device.type != "cuda" or self.attention_backend != "triton" or self.engine_config.enforce_eager:
            return None
        try:
            return DecodeGraphs(
                self.model,
                sizes=capture_sizes(self.engine_config.max_num_seqs),
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                device=self.device,
                capture=True,
            )
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # slower, but serving beats not starting
            logger.warning("CUDA graph capture failed (%s); decoding eagerly. Set enforce_eager to skip it.", exc)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return None

    def _build_cpu_decoder(self) -> CpuDecoder | None:
        """Decode steps in one native call (`cpu_decode.py`) on CPU, float32, with the native kernels and the
        projections in their panels, unless `cpu_fused_decode` is off."""
        if self.device.type != "cpu" or not self.engine_config.cpu_fused_decode or self.num_packed_linears == 0:
            return None
        return CpuDecoder.build(self.model, NATIVE_MAX_ROWS)

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]  # in layer order

    def _allocate_kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The KV cache [2, layers, num_blocks, block_size, KVH, D] in the KV dtype and, for int8, its scales
        [2, layers, num_blocks, KVH] (float32), attached to the attention layers."""
        c = self.model_config
        shape = (2, c.num_hidden_layers, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        if self.device.type == "cpu":
            kv_cache = torch.empty(shape, dtype=self.kv_dtype)
            advise_huge_pages(kv_cache)  # before the first touch, so zeroing faults the cache in as 2 MiB pages
            kv_cache.zero_()
        else:
            kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        scales = None
        if self.kv_dtype == torch.int8:
            scales = torch.zeros(shape[:3] + shape[4:5], dtype=torch.float32, device=self.device)
        for i, attn in enumerate(self._attention_layers()):
            attn.k_cache = kv_cache[0, i]  # [num_blocks, block_size, KVH, D]
            attn.v_cache = kv_cache[1, i]
            attn.k_scale = None if scales is None else scales[0, i]  # [num_blocks, KVH]
            attn.v_scale = None if scales is None else scales[1, i]
        return kv_cache, scales

    # -- one step -----------------------------------------------------------------------------------------------

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids [T], positions [T], attention metadata, logits_indices [N]) on the device.

        Host work per step is proportional to the batch, so decode rows (one token each) take a short path, and
        the inputs reach a GPU in two copies: one int64 buffer (token ids, positions, slots, logits rows) and one
        int32 buffer (context lengths, query offsets, block tables), sliced into views on the device."""
        size = self.block_size
        seqs = batch.seqs
        num_decode_seqs = batch.num_decode_seqs
        decodes = seqs[:num_decode_seqs]
        # A decode row computes the sequence's last token, at position num_tokens - 1, and always samples.
        positions = [len(seq.token_ids) - 1 for seq in decodes]
        input_ids = [seq.token_ids[-1] for seq in decodes]
        tables = [seq.block_table for seq in decodes]
        num_plain = num_decode_seqs + batch.num_verify_seqs
        if batch.num_verify_seqs:
            # A verification is decode rows too: its last token and each proposed token at the next positions,
            # each attending to the KV before it (every layer writes the rows' KV before its attention reads it).
            for seq in seqs[num_decode_seqs:num_plain]:
                start = len(seq.token_ids) - 1
                input_ids.extend((seq.token_ids[-1], *seq.spec_token_ids))
                positions.extend(range(start, start + 1 + len(seq.spec_token_ids)))
                tables.extend([seq.block_table] * (1 + len(seq.spec_token_ids)))
        num_decode = len(input_ids)  # decode rows
        slots = [table[p // size] * size + p % size for table, p in zip(tables, positions, strict=True)]
        context_lens = [p + 1 for p in positions]
        logits_indices = list(range(num_decode))
        prefill_cu = [0]
        for seq, num_new in zip(seqs[num_plain:], batch.num_new_tokens[num_plain:], strict=True):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // size] * size + p % size for p in range(start, end))
            context_lens.append(end)
            prefill_cu.append(prefill_cu[-1] + num_new)
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
        num_tokens = len(input_ids)
        num_prefill = len(seqs) - num_plain
        decode_tables = _block_table_array(tables)
        prefill_tables = _block_table_array([seq.block_table for seq in seqs[num_plain:]])

        longs = np.array(input_ids + positions + slots + logits_indices, dtype=np.int64)
        ints = np.concatenate(
            (
                np.array(context_lens + prefill_cu, dtype=np.int32),
                decode_tables.reshape(-1),
                prefill_tables.reshape(-1),
            )
        )
        longs_t = torch.from_numpy(longs)
        ints_t = torch.from_numpy(ints)
        if self.device.type != "cpu":
            longs_t = longs_t.to(self.device, non_blocking=True)
            ints_t = ints_t.to(self.device, non_blocking=True)
        t = num_tokens
        input_ids_t, positions_t, slots_t = longs_t[:t], longs_t[t : 2 * t], longs_t[2 * t : 3 * t]
        logits_indices_t = longs_t[3 * t :]
        num_seqs = num_decode + num_prefill  # decode rows and prefill sequences: one context length each
        offset = num_seqs + num_prefill + 1
        decode_tables_t = ints_t[offset : offset + decode_tables.size].view(decode_tables.shape)
        offset += decode_tables.size
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            num_decode_tokens=num_decode,
            decode_block_tables=decode_tables_t if num_decode else None,
            decode_context_lens=ints_t[:num_decode] if num_decode else None,
            prefill_block_tables=None,
            prefill_cu_seqlens_q=None,
            prefill_context_lens=None,
            prefill_max_seqlen_q=0,
        )
        if num_prefill:
            meta.prefill_block_tables = ints_t[offset : offset + prefill_tables.size].view(prefill_tables.shape)
            meta.prefill_cu_seqlens_q = ints_t[num_seqs : num_seqs + num_prefill + 1]
            meta.prefill_context_lens = ints_t[num_decode:num_seqs]
            meta.prefill_max_seqlen_q = max(batch.num_new_tokens[num_plain:])
        return input_ids_t, positions_t, meta, logits_indices_t

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; float32 logits [N, vocab] for the N sequences that sample, in batch order (a sequence
        verifying proposed tokens has one row per query position: 1 + len(spec_token_ids))."""
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        if self.graphs is not None and self.graphs.can_run(meta, input_ids.shape[0]):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.cpu_decoder is not None and self.cpu_decoder.can_run(meta, input_ids.shape[0]):
            hidden = self.cpu_decoder.run(input_ids, positions, meta)
        elif logits_indices.shape[0] != input_ids.shape[0]:  # rows are increasing: as many rows means all of them
            hidden = self.model(input_ids, positions, meta, logits_indices)  # a prefill step: sampled rows only
        else:
            hidden = self.model(input_ids, positions, meta)
        return self.model.compute_logits(hidden).float()
