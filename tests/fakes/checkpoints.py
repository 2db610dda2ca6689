"""A tiny random Llama saved as a Hugging Face directory with a tiny byte-level tokenizer (the loader tests'
helpers, tests/local_engine/loading/tiny_checkpoints.py), for tests that start a real engine from a path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["tiny_llama_checkpoint"]

_HELPERS = Path(__file__).resolve().parents[1] / "local_engine" / "loading" / "tiny_checkpoints.py"


def tiny_llama_checkpoint(directory: Path, **config: Any) -> Path:
    """Save the tiny llama (tied embeddings; `config` overrides, e.g. `max_position_embeddings`) into `directory`."""
    spec = importlib.util.spec_from_file_location("fakes_tiny_checkpoints", _HELPERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.tiny_model("llama", tie_word_embeddings=True, **config).save_pretrained(directory)
    module.save_tiny_tokenizer(directory)
    return directory
