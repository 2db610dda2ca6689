"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) in one file.

Flags in `ModelConfig` cover the family differences: q/k/v bias (Qwen2), q/k RMSNorm per head (Qwen3), tied
embeddings (SmolLM2, small Qwen), rope scaling (Llama 3). Parameter names follow Hugging Face so checkpoint
keys map one to one, except two packed projections computed as one matmul each:
`qkv_proj` = cat(q_proj, k_proj, v_proj) and `gate_up_proj` = cat(gate_proj, up_proj) (see `PACKED_MODULES`).

The model knows nothing about scheduling: it takes packed tokens of a step, their positions and the attention
metadata (slot mapping, block tables) built by the model runner.
"""

from __future__ import annotations

import torch
from torch import nn

from local_engine.config import ModelConfig
from local_engine.errors import ModelLoadError
from local_engine.layers.attention import Attention, AttentionMetadata
from local_engine.layers.backend import Ops
from local_engine.layers.norm import RMSNorm
from local_engine.layers.rotary import build_cos_sin_cache

__all__ = ["PACKED_MODULES", "LlamaForCausalLM"]

# Rows of the output embedding per GEMM when computing logits on CPU (a slice of ~9 MB stays in cache).
LOGITS_SLICE_ROWS = 4096

# checkpoint name fragment -> (packed module fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.ops = ops
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.has_qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.has_o_bias)
        if config.has_qk_norm:
            self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """With `output_rows`, every token's K and V still go to the cache, but only those rows of the attention
        output go on through the output projection (the last layer of a prefill step: see `LlamaModel`)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 normalises each head over head_dim before rope.
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view(num_tokens, self.num_kv_heads, self.head_dim)
        self.ops.apply_rotary(q, k, positions, cos_sin)
        out = self.attn(q, k, v, meta).reshape(num_tokens, self.q_size)  # [T, H * D]
        projected: torch.Tensor = self.o_proj(out if output_rows is None else out[output_rows])
        return projected


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(
            self.ops.silu_and_mul(self.gate_up_proj(x))
        )  # [T, 2I] -> [T, I] -> [T, hidden]
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: `residual` carries the running sum between layers.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)[0]
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, cos_sin, meta, output_rows)
        if output_rows is not None:
            residual = residual[output_rows]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, ops) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    @property
    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """`layers` with their class (an `nn.ModuleList` holds plain `nn.Module`s to a type checker)."""
        layers = []
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layers.append(layer)
        return layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden], or [len(output_rows), hidden] for just those rows (increasing token
        indices). Only the last layer's K and V are needed of the other tokens, so from its attention output on
        the layer runs on the output rows alone: in a prefill step, the sampled rows are one per sequence and the
        last layer's o projection and MLP (5/6 of its weights' work) are skipped for all the rest, as llama.cpp
        does."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, cos_sin, meta, output_rows if i == last else None)
        normed: torch.Tensor = self.norm(hidden, residual)[0]
        return normed


class LlamaForCausalLM(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer (`register_buffer` below), which mypy cannot see as an attribute

    def __init__(self, config: ModelConfig, ops: Ops, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Shared by every layer; a buffer so it follows the model to its device (kept in float32).
        cache = build_cos_sin_cache(config.head_dim, max_position, config.rope_theta, config.rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden] (or of `output_rows` only: see `LlamaModel`)."""
        hidden: torch.Tensor = self.model(input_ids, positions, self.cos_sin_cache, meta, output_rows)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab]. With a plain `nn.Linear` on CPU and several rows the vocabulary is computed
        in slices: one MKL GEMM over the whole (cache-busting) embedding matrix runs at a fraction of the speed of
        cache-sized ones. (A packed lm_head — `layers/linear.py` — is faster still, in one call.)"""
        if not isinstance(self.lm_head, nn.Linear) or hidden.device.type != "cpu" or hidden.shape[0] == 1:
            logits: torch.Tensor = self.lm_head(hidden)
            return logits
        weight = self.lm_head.weight
        logits_t = torch.empty(weight.shape[0], hidden.shape[0], dtype=hidden.dtype)  # [vocab, N]
        hidden_t = hidden.t().contiguous()  # [hidden, N]
        for start in range(0, weight.shape[0], LOGITS_SLICE_ROWS):
            end = start + LOGITS_SLICE_ROWS
            torch.mm(weight[start:end], hidden_t, out=logits_t[start:end])
        return logits_t.t()

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, packing q/k/v and gate/up. Raises on missing or unexpected keys."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in state_dict.items():
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, offset, size = self._locate(name, tensor)
            if target not in params:
                raise ModelLoadError(f"unexpected checkpoint tensor {name!r}")
            param = params[target]
            dest = param.data.narrow(0, offset, size) if target != name else param.data
            if dest.shape != tensor.shape:
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{target}@{offset}")
        expected = {f"{n}@{off}" for n in params for off in self._shard_offsets(n)}
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight@0")
        missing = expected - loaded
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _locate(self, name: str, tensor: torch.Tensor) -> tuple[str, int, int]:
        """(model parameter name, row offset, rows) for a checkpoint tensor."""
        for fragment, (packed, shard) in PACKED_MODULES.items():
            if f".{fragment}." in name:
                return name.replace(fragment, packed), sum(self._shard_sizes(packed)[:shard]), tensor.shape[0]
        return name, 0, tensor.shape[0]

    def _shard_sizes(self, packed: str) -> list[int]:
        c = self.config
        if packed == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    def _shard_offsets(self, name: str) -> list[int]:
        for packed in ("qkv_proj", "gate_up_proj"):
            if f".{packed}." in name:
                sizes = self._shard_sizes(packed)
                return [sum(sizes[:i]) for i in range(len(sizes))]
        return [0]
