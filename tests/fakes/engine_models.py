"""Session fixtures with real engine parts, shared by the engine's and the local backend's tests: the bundled
model's checkpoint and tokenizer, a tiny random Llama saved as an HF directory with that tokenizer, and a sampler
whose output a test scripts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.config import LocalEngineOptions
from local_engine.sampler import SamplerOutput


def tiny_engine_options(model_dir: Path | str | None = None, **overrides: Any) -> LocalEngineOptions:
    """The engine settings the tests run a tiny model with (CPU, 2 MiB of KV cache, 8 sequences, 64-token steps),
    with `overrides`; `model_dir` (e.g. `tiny_model_dir`) as its model path when given."""
    settings: dict[str, Any] = {"device": "cpu", "kv_cache_memory": 2 * 2**20, "max_num_seqs": 8}
    settings["max_num_batched_tokens"] = 64
    if model_dir is not None:
        settings["model_path"] = str(model_dir)
    return LocalEngineOptions(**(settings | overrides))


@pytest.fixture(scope="session")
def bundled_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The bundled SmolLM2-135M-Instruct through E2's loader (GGUF dequantized once per session)."""
    from local_engine.loader import bundled_model_path, load_checkpoint

    return load_checkpoint(bundled_model_path(), cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def transformers_bundled_model() -> Any:
    """transformers' own GGUF load of the bundled model (float32, eval mode): the reference the loader and the engine
    are checked against. Loaded once per session (~20 s)."""
    from transformers import AutoModelForCausalLM

    from local_engine.loader import bundled_model_path

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


@pytest.fixture(scope="session")
def real_tokenizer(bundled_checkpoint: Any) -> Any:
    """The bundled model's tokenizer (byte-level BPE, from the GGUF metadata)."""
    return bundled_checkpoint.tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, real_tokenizer: Any) -> Path:
    """A tiny random Llama saved as a Hugging Face directory with the bundled model's real tokenizer."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=real_tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=None,  # random weights: no EOS, so outputs run to max_tokens
        initializer_range=0.3,
    )
    directory = tmp_path_factory.mktemp("tiny-hf")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    real_tokenizer.hf.save_pretrained(directory)
    return directory


class ScriptedSampler:
    """Stands in for `local_engine.sampler.Sampler`: every sequence "samples" `token_ids` (settable between
    requests), then EOS. Records each request's prompt."""

    def __init__(self, eos_token_id: int, token_ids: list[int] | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.token_ids: list[int] = list(token_ids or [])
        self.prompts: list[list[int]] = []

    def __call__(self, logits: Any, seqs: list[Any]) -> SamplerOutput:
        token_ids = []
        for seq in seqs:
            position = len(seq.token_ids) - seq.num_prompt_tokens
            if position == 0:
                self.prompts.append(seq.token_ids[: seq.num_prompt_tokens])
            token_ids.append(self.token_ids[position] if position < len(self.token_ids) else self.eos_token_id)
        return SamplerOutput(token_ids, [None] * len(seqs))

    def forget(self, seq: Any) -> None:
        pass
