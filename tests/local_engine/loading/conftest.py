"""Fixtures for the loader tests: the bundled GGUF loaded once per session, and tiny GGUF files on demand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from local_engine.loader import Checkpoint, bundled_model_path, load_checkpoint

from .tiny_checkpoints import write_gguf


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("weights-cache")


@pytest.fixture(scope="session")
def bundled_first_load(bundled_path: Path, session_cache_dir: Path) -> Checkpoint:
    """The bundled model converted from GGUF (and written to the session's weights cache)."""
    return load_checkpoint(bundled_path, cache_dir=session_cache_dir)


@pytest.fixture(scope="session")
def bundled_cached_load(bundled_first_load: Checkpoint, bundled_path: Path, session_cache_dir: Path) -> Checkpoint:
    """The bundled model again, now read from the weights cache."""
    return load_checkpoint(bundled_path, cache_dir=session_cache_dir)


@pytest.fixture(scope="session")
def transformers_gguf_state_dict(transformers_bundled_model: Any) -> dict[str, torch.Tensor]:
    """transformers' own GGUF load of the same file: the reference for names, un-permutation and dequantization."""
    return {name: tensor.detach().clone() for name, tensor in transformers_bundled_model.state_dict().items()}


@pytest.fixture
def gguf_writer(tmp_path: Path) -> Callable[..., Path]:
    """write_gguf bound to a fresh file name under the test's tmp dir."""
    counter = iter(range(1000))

    def write(model: Any, arch: str, **options: Any) -> Path:
        return write_gguf(tmp_path / f"tiny-{next(counter)}.gguf", model, arch, **options)

    return write
