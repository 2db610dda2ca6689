"""Tiny randomly initialised transformers models, one per family, and an engine over each (tests import them from
here; tests/local_engine/conftest.py turns them into fixtures)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine

__all__ = ["COMMON", "VOCAB", "TinyModel", "tiny_model"]

VOCAB = 160
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # Larger weights than the default 0.02 give peaked logits, so greedy ties between implementations that
    # differ by float rounding do not happen.
    "initializer_range": 0.3,
    # No EOS: generation runs to max_new_tokens on both sides (tests that need EOS set it on the engine).
    "eos_token_id": None,
    "bos_token_id": 1,
}


@dataclass
class TinyModel:
    name: str
    hf: Any  # the transformers model
    hf_config: dict[str, Any]

    def engine(self, **overrides: Any) -> LLMEngine:
        options: dict[str, Any] = {"device": "cpu", "kv_cache_memory": 4 * 2**20, "max_num_seqs": 16}
        options.update(overrides)
        return LLMEngine(ModelConfig.from_hf_config(self.hf_config), EngineConfig(**options), self.hf.state_dict())

    def hf_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return list(out[0, len(prompt) :].tolist())


def _build(name: str) -> TinyModel:
    import transformers

    torch.manual_seed(0)
    if name == "llama3":  # Llama 3 rope scaling, untied embeddings
        config = transformers.LlamaConfig(
            **COMMON,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    elif name == "qwen2":  # qkv bias, tied embeddings
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif name == "qwen3":  # q/k norm, head_dim != hidden / heads
        config = transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        raise ValueError(name)
    model.eval()
    return TinyModel(name, model, config.to_dict())


_MODELS: dict[str, TinyModel] = {}


def tiny_model(name: str) -> TinyModel:
    if name not in _MODELS:
        _MODELS[name] = _build(name)
    return _MODELS[name]
