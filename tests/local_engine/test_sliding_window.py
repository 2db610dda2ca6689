"""A checkpoint with sliding-window attention (Mistral v0.1) is served at most its window, never silently wrong.

The engine attends to the whole context; within the window that is what sliding-window attention computes too,
so the served context is capped at the window with a start-up warning (`EngineConfig.resolved_max_model_len`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from loading.tiny_checkpoints import save_tiny_tokenizer

from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine
from local_engine.errors import PromptTooLongError
from local_engine.loader import load_checkpoint
from local_engine.sampling_params import SamplingParams

WINDOW = 32
VOCAB = 263  # the tiny tokenizer's (loading/tiny_checkpoints.py)
ENGINE = EngineConfig(device="cpu", kv_cache_memory=4 * 2**20, max_num_seqs=16)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A random-weight Mistral with a 32-token window and a 256-token context, saved as an HF directory."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        initializer_range=0.3,  # peaked logits: no greedy ties between implementations
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.MistralForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("mistral-window")
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return model, directory


def _prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(prompt) :].tolist())


def test_served_context_is_capped_at_the_window_with_a_warning(
    mistral: tuple[Any, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, directory = mistral
    with caplog.at_level(logging.WARNING, logger="unigate.engine"):
        engine = LLMEngine.from_checkpoint(load_checkpoint(directory), ENGINE)
    assert engine.max_model_len == WINDOW
    (warning,) = [r.getMessage() for r in caplog.records if "sliding-window" in r.getMessage()]
    assert str(directory) in warning
    assert "mistral" in warning
    assert f"capped at {WINDOW} tokens (was 256)" in warning
    # A request that does not fit in the window is refused (the gateway answers 400 context_length_exceeded).
    with pytest.raises(PromptTooLongError):
        engine.add_request("too-long-prompt", _prompts([WINDOW])[0], SamplingParams(max_tokens=1, **GREEDY))
    with pytest.raises(PromptTooLongError):
        engine.add_request("too-long-output", _prompts([20])[0], SamplingParams(max_tokens=WINDOW - 19, **GREEDY))


def test_an_explicit_shorter_max_model_len_is_kept_without_a_warning(
    mistral: tuple[Any, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, directory = mistral
    with caplog.at_level(logging.WARNING, logger="unigate.engine"):
        engine = LLMEngine.from_checkpoint(load_checkpoint(directory), ENGINE.model_copy(update={"max_model_len": 24}))
    assert engine.max_model_len == 24
    assert not [r for r in caplog.records if "sliding-window" in r.getMessage()]


def test_greedy_tokens_within_the_window_equal_transformers(mistral: tuple[Any, Path]) -> None:
    model, directory = mistral
    engine = LLMEngine.from_checkpoint(load_checkpoint(directory), ENGINE)
    prompts = _prompts([3, 7, 12, 20, 31])
    # Each sequence runs to the full window: prompt + completion = 32 tokens.
    params = [SamplingParams(max_tokens=WINDOW - len(p), **GREEDY) for p in prompts]
    outputs = engine.generate(prompts, params)
    for prompt, (choice,) in zip(prompts, outputs, strict=True):
        assert len(prompt) + len(choice.token_ids) == WINDOW
        assert choice.token_ids == _hf_greedy(model, prompt, WINDOW - len(prompt))


def test_past_the_window_full_attention_would_give_other_tokens(mistral: tuple[Any, Path]) -> None:
    """Why the cap exists: the same weights with the window ignored (what the engine computed before) diverge from
    transformers' sliding-window attention once sequences pass 32 tokens."""
    model, directory = mistral
    checkpoint = load_checkpoint(directory)
    uncapped = dataclasses.replace(ModelConfig.from_hf_config(checkpoint.hf_config), sliding_window=None)
    engine = LLMEngine(uncapped, ENGINE, checkpoint.state_dict)
    assert engine.max_model_len == 256
    prompts = _prompts([24, 28, 30, 30, 31, 31])
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    num_diverged = sum(
        choice.token_ids != _hf_greedy(model, prompt, 24) for prompt, (choice,) in zip(prompts, outputs, strict=True)
    )
    assert num_diverged > 0


@pytest.mark.parametrize(
    ("hf", "expected"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096),
        ({"model_type": "mistral", "sliding_window": None}, None),  # Mistral v0.2 and later
        ({"model_type": "llama", "sliding_window": 64}, None),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, None),  # Qwen2.5
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}, 64),
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2}, None),
        (
            {
                "model_type": "qwen3",
                "sliding_window": 64,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            64,
        ),
    ],
)
def test_which_checkpoints_have_a_window(hf: dict[str, Any], expected: int | None) -> None:
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 256,
    }
    config = ModelConfig.from_hf_config({**shape, **hf})
    assert config.sliding_window == expected
    assert EngineConfig().resolved_max_model_len(config) == min(expected or 256, 256)
