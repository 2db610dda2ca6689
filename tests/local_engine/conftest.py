"""Tiny randomly initialised transformers models (one per family) and the bundled model's real tokenizer."""

from __future__ import annotations

import pytest
from fakes.tiny_models import COMMON, VOCAB, TinyModel, tiny_model  # noqa: F401


@pytest.fixture(params=["llama3", "qwen2", "qwen3"])
def family(request: pytest.FixtureRequest) -> TinyModel:
    return tiny_model(request.param)


@pytest.fixture
def llama() -> TinyModel:
    return tiny_model("llama3")
