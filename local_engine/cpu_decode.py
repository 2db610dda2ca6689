"""Decode steps on the CPU in one native call: the whole decoder stack of a pure-decode batch at once.

The CPU counterpart of `cuda_graphs.py`. A decode step of a small model on a CPU is a few hundred small calls:
per layer two RMSNorms, four projections, rotary, the KV cache write, attention and silu-and-mul, each a Python
call with its argument checks, a fresh output tensor and an OpenMP fork/join. At decode sizes (a few dozen rows)
that cost is a large share of the step: SmolLM2-135M's RMSNorm over 31 rows took 72 us per call inside a step,
16 us on its own. `unigate_decode_layers_f32` (kernels/cpu/kernels.c) runs the same kernels, in the same order
and on the same data, inside one parallel region, so the hidden states it returns equal the op-by-op forward's
bit for bit (the tests check it); the embedding lookup before it and the logits after it stay in torch.

It applies to float32 models on CPU (KV cache float32, or int8 with its scales) with the native kernels on and
every projection kept in the native kernel's panels (`layers/linear.py`, `PackedLinear` with `native_max_rows`;
float32, or all four kinds in a GGUF file's own Q4_1 / Q8_0 blocks), to pure-decode batches of at most that many
rows. Anything else (prefill and mixed
steps, larger batches, other dtypes) takes the model's forward.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from local_engine.kernels import cpu as cpu_kernels
from local_engine.layers.attention import AttentionMetadata
from local_engine.layers.linear import PackedLinear
from local_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["CpuDecoder"]

logger = logging.getLogger("unigate.engine")


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def _scale_pointers(scales: list[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p] | None:
    return None if scales[0] is None else _pointers([s for s in scales if s is not None])


def _as_pointer(array: ctypes.Array[ctypes.c_void_p] | None) -> ctypes._Pointer[ctypes.c_void_p] | None:
    """A `void **` struct field: the array's first element, or NULL."""
    return None if array is None else ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p))


class CpuDecoder:
    """The model's weights as the native decoder reads them, plus scratch for `max_rows` rows."""

    def __init__(self, model: LlamaForCausalLM, kernel: cpu_kernels.Kernel, max_rows: int) -> None:
        self.kernel = kernel
        self.max_rows = max_rows
        config = model.config
        layers = model.model.decoder_layers
        attn0 = layers[0].self_attn
        self.embed = model.model.embed_tokens.weight
        self.hidden = config.hidden_size
        qkv_size = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        q_size = config.num_attention_heads * config.head_dim
        self.scratch = torch.empty(
            max_rows * (2 * self.hidden + qkv_size + q_size + 2 * config.intermediate_size), dtype=torch.float32
        )

        per_layer = [_projections(layer) for layer in layers]

        def panels(name: str) -> list[torch.Tensor]:
            return [panel for projections in per_layer if (panel := projections[name].panels) is not None]

        def biases(name: str) -> ctypes.Array[ctypes.c_void_p] | None:
            found = [projections[name].bias for projections in per_layer]
            return None if found[0] is None else _pointers([b for b in found if b is not None])

        norms = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
        # The pointer arrays the struct points at, kept alive with it; the tensors are the model's and the KV
        # cache's own, which live as long as the model runner does.
        self._arrays = {
            "input_norm": _pointers([layer.input_layernorm.weight for layer in layers]),
            "post_norm": _pointers([layer.post_attention_layernorm.weight for layer in layers]),
            "q_norm": None if attn0.q_norm is None else _pointers([q.weight for q, _ in norms if q is not None]),
            "k_norm": None if attn0.k_norm is None else _pointers([k.weight for _, k in norms if k is not None]),
            "qkv": _pointers(panels("qkv_proj")),
            "qkv_bias": biases("qkv_proj"),
            "o": _pointers(panels("o_proj")),
            "o_bias": biases("o_proj"),
            "gate_up": _pointers(panels("gate_up_proj")),
            "down": _pointers(panels("down_proj")),
            "k_cache": _pointers([layer.self_attn.attn.k_cache for layer in layers]),
            "v_cache": _pointers([layer.self_attn.attn.v_cache for layer in layers]),
            # an int8 KV cache's scales [num_blocks, KVH] per layer; none for a float32 cache
            "k_scale": _scale_pointers([layer.self_attn.attn.k_scale for layer in layers]),
            "v_scale": _scale_pointers([layer.self_attn.attn.v_scale for layer in layers]),
        }
        # The runner attaches the KV cache once; `run` checks that the first layer still holds the one pointed at.
        self._attention, self._k_cache = attn0.attn, attn0.attn.k_cache
        self.weights = cpu_kernels.DecoderWeights(
            num_layers=len(layers),
            hidden=self.hidden,
            inter=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=attn0.attn.k_cache.shape[1],
            weight_format=per_layer[0]["qkv_proj"].weight_format,
            eps=config.rms_norm_eps,
            scale=attn0.attn.scale,
            final_norm=model.model.norm.weight.data_ptr(),
            cos_sin=model.cos_sin_cache.data_ptr(),
            **{name: _as_pointer(array) for name, array in self._arrays.items()},
        )

    @classmethod
    def build(cls, model: LlamaForCausalLM, max_rows: int) -> CpuDecoder | None:
        """The decoder for a model whose every part it handles (see the module's docstring); None, with the reason
        logged at debug level, otherwise."""
        kernel = cpu_kernels.load()
        reason = "the native CPU kernels are unavailable" if kernel is None else _unsupported(model, kernel, max_rows)
        if reason is not None or kernel is None:
            logger.debug("decode steps run op by op: %s", reason)
            return None
        return cls(model, kernel, max_rows)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A pure-decode batch (one token per sequence) of at most `max_rows` sequences."""
        return meta.num_decode_tokens == num_tokens and 0 < num_tokens <= self.max_rows

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [B, hidden] of a pure-decode batch, as `model(input_ids, positions, meta)`."""
        tables, context_lens = meta.decode_block_tables, meta.decode_context_lens
        assert tables is not None and context_lens is not None
        assert all(t.is_contiguous() for t in (input_ids, positions, meta.slot_mapping, tables, context_lens))
        assert tables.dtype == context_lens.dtype == torch.int32
        assert positions.dtype == meta.slot_mapping.dtype == input_ids.dtype == torch.int64
        assert self._attention.k_cache is self._k_cache, "the KV cache moved"
        num_rows = input_ids.shape[0]
        residual = torch.index_select(self.embed, 0, input_ids)  # the residual stream starts as the embeddings
        out = torch.empty((num_rows, self.hidden), dtype=torch.float32)
        failed = self.kernel.decode_layers(
            ctypes.byref(self.weights),
            num_rows,
            residual.data_ptr(),
            out.data_ptr(),
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            context_lens.data_ptr(),
            tables.shape[1],
            self.scratch.data_ptr(),
        )
        if failed:
            raise MemoryError("the native decoder could not allocate a dequantized weight panel")
        return out


def _projections(layer: LlamaDecoderLayer) -> dict[str, PackedLinear]:
    """The layer's four projections by name, each in the native kernel's panels (`_unsupported` checked it)."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = {
        "qkv_proj": attention.qkv_proj,
        "o_proj": attention.o_proj,
        "gate_up_proj": mlp.gate_up_proj,
        "down_proj": mlp.down_proj,
    }
    packed: dict[str, PackedLinear] = {}
    for name, linear in linears.items():
        assert isinstance(linear, PackedLinear)
        packed[name] = linear
    return packed


def _unsupported(model: LlamaForCausalLM, kernel: cpu_kernels.Kernel, max_rows: int) -> str | None:
    """Why the native decoder cannot run this model, or None when it can."""
    config = model.config
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return "the weights are not float32 on CPU"
    layers = model.model.decoder_layers
    formats: set[int] = set()
    for layer in layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(linear, PackedLinear) or linear.panels is None or linear.native_max_rows < max_rows:
                return "the projections are not packed in the native kernel's panels"
            formats.add(linear.weight_format)
    if len(formats) > 1:
        return "the projections' panels hold weights in more than one format"
    for layer in layers:
        attn = layer.self_attn.attn
        if not (attn.k_cache.dim() == 4 and attn.k_cache.is_contiguous() and attn.v_cache.is_contiguous()):
            return "the KV cache is not allocated"
        is_int8 = attn.k_cache.dtype == torch.int8 and attn.k_scale is not None and attn.v_scale is not None
        if attn.k_cache.dtype != torch.float32 and not is_int8:
            return f"the KV cache is {attn.k_cache.dtype} (the native decoder reads float32 or int8)"
        if is_int8 and config.head_dim > kernel.max_head_dim:
            return "the head dim is past the int8 KV write's limit"
    group = config.num_attention_heads // config.num_key_value_heads
    block_size = layers[0].self_attn.attn.k_cache.shape[1]
    if not (
        config.num_attention_heads <= kernel.max_heads
        and group <= kernel.max_group
        and config.head_dim % kernel.lanes == 0
        and config.head_dim <= kernel.max_head_dim
        and block_size <= kernel.max_block_size
    ):
        return "the attention shape is past the decode kernel's limits"
    cos_sin = model.cos_sin_cache
    if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous() or cos_sin.shape[1] != config.head_dim:
        return "the rotary table is not float32 [positions, head_dim]"
    return None
