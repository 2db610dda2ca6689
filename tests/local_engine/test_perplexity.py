"""Perplexity through the engine's own forward pass, against a direct transformers computation, and the start-up
quality check (`UNIGATE_ENGINE__QUANTIZATION_CHECK`)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from loading.tiny_checkpoints import save_tiny_tokenizer, tiny_model

from backends.config import LocalEngineOptions
from backends.local import LocalBackendConfig, load_engine
from local_engine import perplexity as ppl
from local_engine.config import EngineConfig
from local_engine.engine import LLMEngine
from local_engine.loader import load_checkpoint
from local_engine.sampling_params import SamplingParams

ENGINE = {"device": "cpu", "kv_cache_memory": 4 * 2**20}


def _tokens(vocab: int, n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=generator).tolist()


def _hf_perplexity(model: Any, tokens: list[int], window: int, stride: int) -> tuple[float, int]:
    """transformers' sliding-window perplexity, written out: each window scores the tokens the previous did not."""
    total, num_scored, scored_end = 0.0, 0, 1
    with torch.no_grad():
        for begin in range(0, len(tokens), stride):
            end = min(begin + window, len(tokens))
            first = max(scored_end, begin + 1)
            if end > first:
                logits = model(torch.tensor([tokens[begin:end]])).logits[0].float()  # [L, vocab]
                rows = logits[first - begin - 1 : end - begin - 1]
                targets = torch.tensor(tokens[first:end])
                total += float(torch.nn.functional.cross_entropy(rows, targets, reduction="sum"))
                num_scored += end - first
                scored_end = end
            if end == len(tokens):
                break
    return math.exp(total / num_scored), num_scored


@pytest.mark.parametrize(
    ("num_tokens", "window", "stride"),
    [(60, None, None), (100, 40, 16), (97, 32, 32), (70, 40, 25)],
)
def test_perplexity_equals_transformers(family: Any, num_tokens: int, window: int | None, stride: int | None) -> None:
    engine = family.engine()
    tokens = _tokens(family.hf.config.vocab_size, num_tokens)
    result = ppl.perplexity(engine, tokens, window=window, stride=stride)
    expected, num_scored = _hf_perplexity(family.hf, tokens, result.window, result.stride)
    assert result.num_tokens == num_scored
    # Every token but the first is scored; with windows that do not overlap, each window's first is not either.
    skipped = len(range(0, num_tokens, result.stride)) - 1 if result.stride == result.window else 0
    assert num_scored == num_tokens - 1 - skipped
    assert result.value == pytest.approx(expected, rel=1e-4)


def test_the_default_window_is_the_engine_context(llama: Any) -> None:
    engine = llama.engine(max_model_len=64)
    result = ppl.perplexity(engine, _tokens(llama.hf.config.vocab_size, 100))
    assert (result.window, result.stride) == (64, 32)


def test_the_engine_serves_as_before_afterwards(llama: Any) -> None:
    """perplexity writes into the engine's KV cache blocks and resets its scheduling state (the prefix cache)."""
    engine = llama.engine()
    prompt = _tokens(llama.hf.config.vocab_size, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (before,) = engine.generate([prompt], params)
    ppl.perplexity(engine, _tokens(llama.hf.config.vocab_size, 200, seed=4), window=64)
    (after,) = engine.generate([prompt], params)  # the same prompt again: a prefix-cache hit without the reset
    assert after[0].token_ids == before[0].token_ids == llama.hf_greedy(prompt, 8)


def test_refuses_a_busy_engine_and_short_input(llama: Any) -> None:
    engine = llama.engine()
    with pytest.raises(ValueError, match="at least 2 tokens"):
        ppl.perplexity(engine, [5])
    with pytest.raises(ValueError, match="window must hold at least 2 tokens"):
        ppl.perplexity(engine, [5, 6, 7], window=1)
    engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle engine"):
        ppl.perplexity(engine, [5, 6, 7, 8])


def test_an_int8_kv_cache_is_measured(llama: Any) -> None:
    """The windows are read back from the engine's own KV cache: an int8 cache changes the figure, a little."""
    tokens = _tokens(llama.hf.config.vocab_size, 120, seed=5)
    full = ppl.perplexity(llama.engine(), tokens, window=64)
    int8 = ppl.perplexity(llama.engine(kv_cache_dtype="int8"), tokens, window=64)
    assert int8.value != full.value
    assert int8.value == pytest.approx(full.value, rel=0.05)


def test_evaluation_text_is_the_shipped_constitution() -> None:
    text = ppl.evaluation_text()
    assert text.startswith("The Constitution of the United States of America")
    assert "Amendment XXVII" in text
    assert len(text.split()) > 7000


# -- the start-up quality check ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a byte-level tokenizer, as an HF directory."""
    directory = tmp_path_factory.mktemp("tiny-quality")
    tiny_model("llama", initializer_range=0.3).save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


def _check_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("quantization check")]


def test_quality_check_compares_with_float32(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = LLMEngine.from_checkpoint(load_checkpoint(tiny_dir), EngineConfig(**ENGINE, kv_cache_dtype="int8"))
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        report = ppl.check_quality(engine, lambda: load_checkpoint(tiny_dir), num_tokens=200)
    assert report is not None
    assert report.setting == "KV int8"
    assert report.threshold == 0.01
    # The reference is the same tokens through a float32 engine.
    tokens = engine.tokenizer.encode(ppl.evaluation_text())[:200]
    float32 = LLMEngine.from_checkpoint(load_checkpoint(tiny_dir), EngineConfig(**ENGINE))
    assert report.reference.value == pytest.approx(ppl.perplexity(float32, tokens).value, rel=1e-6)
    assert report.served.value == pytest.approx(ppl.perplexity(engine, tokens).value, rel=1e-6)
    assert report.served.value != report.reference.value
    (record,) = _check_records(caplog)
    assert record.levelno == (logging.INFO if report.is_within_threshold else logging.WARNING)
    assert f"{report.served.value:.3f} vs {report.reference.value:.3f}" in record.getMessage()


def test_quality_check_warns_past_the_threshold(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ppl.QUALITY_THRESHOLDS, "int8", -1.0)  # any figure is past it
    engine = LLMEngine.from_checkpoint(load_checkpoint(tiny_dir), EngineConfig(**ENGINE, kv_cache_dtype="int8"))
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        report = ppl.check_quality(engine, lambda: load_checkpoint(tiny_dir), num_tokens=64)
    assert report is not None and not report.is_within_threshold
    (record,) = _check_records(caplog)
    assert record.levelno == logging.WARNING
    assert "loses more than expected" in record.getMessage()


def test_quality_check_has_nothing_to_check_unquantized(tiny_dir: Path) -> None:
    engine = LLMEngine.from_checkpoint(load_checkpoint(tiny_dir), EngineConfig(**ENGINE))
    assert ppl.check_quality(engine, lambda: pytest.fail("no reference is needed")) is None


def test_the_local_backend_runs_the_check_at_start_up(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = LocalEngineOptions(model_path=str(tiny_dir), **ENGINE, kv_cache_dtype="int8", quantization_check=True)
    config = LocalBackendConfig(name="tiny", model_id="tiny", cache_dir=tmp_path, engine=options)
    with caplog.at_level(logging.INFO, logger="unigate.engine"):
        engine = load_engine(config)
    try:
        (record,) = _check_records(caplog)
        assert "KV int8" in record.getMessage()
        assert "in float32 on the first 512 tokens" in record.getMessage()
    finally:
        engine.stop()
