"""The bundled SmolLM2-135M-Instruct through our engine equals transformers' own GGUF load, greedy, token for token."""

from __future__ import annotations

from typing import Any

import torch

from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Write one sentence about 春天 and 🌸.", "List three prime numbers."]
MAX_NEW = 24


def test_bundled_model_matches_transformers_greedy(bundled_checkpoint: Any, transformers_bundled_model: Any) -> None:
    reference = transformers_bundled_model
    tokenizer = bundled_checkpoint.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    # A small token budget: the prompts are prefilled in chunks alongside each other's decodes.
    engine = LLMEngine.from_checkpoint(
        bundled_checkpoint,
        EngineConfig(device="cpu", kv_cache_memory=64 * 2**20, max_num_batched_tokens=32, max_num_seqs=4),
    )
    # decode steps read the file's own Q4_1 projections and Q8_0 output embedding (tests/local_engine/
    # test_gguf_block_panels.py): the same float32 results, checked here against transformers end to end
    assert engine.runner.block_panels == {"Q4_1": 4 * 30, "Q8_0": 1}
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for prompt, [choice] in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
            )
        expected = generated[0, len(prompt) :].tolist()
        assert choice.token_ids == expected
        assert choice.text == tokenizer.decode(expected)
