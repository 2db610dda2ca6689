"""Perplexity of the served model, through the engine's own forward pass, and the start-up quality check.

    perplexity(engine, token_ids, window=None, stride=None) -> Perplexity
    evaluation_text() -> str                       the shipped evaluation text (see below)
    check_quality(engine, load_reference, ...)     UNIGATE_ENGINE__QUANTIZATION_CHECK=true: served vs float32

`perplexity` runs the engine's model (its weights as served: dtype, quantization, GGUF block panels, and its KV
cache dtype, since every attention reads its keys back from the paged cache) over windows of the token sequence,
each a single prefill into the engine's own KV cache, and scores each token once. A sequence longer than a window
is evaluated with a sliding window: windows start every `stride` tokens and each scores only the tokens the previous
one did not, with up to `window - stride` tokens of context before them (as transformers' perplexity guide does).

It uses the engine's KV cache blocks directly, so the engine must be idle and no thread may step it meanwhile (at
start-up, in tests and in benchmarks); afterwards the engine's scheduling state is reset (its prefix cache would
otherwise point at overwritten blocks).

The evaluation text is the Constitution of the United States (public domain), as shipped by Debian's `miscfiles`
package (`/usr/share/state/us-constitution.gz`, from the U.S. Senate's site): about 10,700 tokens for SmolLM2's
tokenizer. `local_engine/data/README.md` says how to reproduce the file.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import torch

from local_engine.config import EngineConfig, ModelConfig
from local_engine.engine import LLMEngine
from local_engine.errors import EngineBusyError, InvalidParamError
from local_engine.layers.attention import AttentionMetadata
from local_engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from local_engine.loader import Checkpoint

__all__ = ["QUALITY_THRESHOLDS", "Perplexity", "QualityReport", "check_quality", "evaluation_text", "perplexity"]

logger = logging.getLogger("unigate.engine")

EVALUATION_TEXT = "us-constitution.txt"
LOGITS_ROWS = 256  # rows of logits computed at a time (256 x a 49k vocabulary x 4 bytes = 48 MiB)
# The largest perplexity increase over float32 the start-up check accepts without a warning, by setting.
QUALITY_THRESHOLDS = {"int8": 0.01, "int4": 0.05}
CHECK_NUM_TOKENS = 512  # the evaluation text's prefix the start-up check scores (a few seconds on a CPU)


@dataclass(frozen=True)
class Perplexity:
    value: float  # exp(mean_nll)
    mean_nll: float  # nats per scored token
    num_tokens: int  # tokens scored: all but the first (and, when stride = window, each window's first)
    window: int
    stride: int


def evaluation_text() -> str:
    """The shipped English evaluation text (the U.S. Constitution, public domain)."""
    return resources.files("local_engine").joinpath("data", EVALUATION_TEXT).read_text(encoding="utf-8")


@torch.inference_mode()
def perplexity(
    engine: LLMEngine, token_ids: list[int], *, window: int | None = None, stride: int | None = None
) -> Perplexity:
    """Perplexity of `engine`'s model over `token_ids` (at least 2), with windows of `window` tokens (default: the
    most the engine's context and KV cache hold) starting every `stride` tokens (default: half a window)."""
    if engine.has_unfinished_requests:
        raise EngineBusyError("perplexity needs an idle engine: it runs in the engine's own KV cache")
    if len(token_ids) < 2:
        raise InvalidParamError("perplexity needs at least 2 tokens", param="token_ids")
    capacity = engine.capacity.num_tokens
    window = min(window or engine.max_model_len, engine.max_model_len, capacity)
    stride = stride or max(1, window // 2)
    if window < 2:
        raise InvalidParamError(f"the window must hold at least 2 tokens, got {window}", param="window")
    if not 0 < stride <= window:
        raise InvalidParamError(f"stride ({stride}) must be in [1, window ({window})]", param="stride")
    total_nll = 0.0
    num_scored = 0
    scored_end = 1  # the first token has no prediction
    try:
        for begin in range(0, len(token_ids), stride):
            end = min(begin + window, len(token_ids))
            first = max(scored_end, begin + 1)  # a window's first token has no context in it
            if end > first:
                total_nll += _window_nll(engine, token_ids[begin:end], first - begin)
                num_scored += end - first
                scored_end = end
            if end == len(token_ids):
                break
    finally:
        engine.reset()
    mean = total_nll / num_scored
    return Perplexity(math.exp(mean), mean, num_scored, window, stride)


def _window_nll(engine: LLMEngine, tokens: list[int], first_scored: int) -> float:
    """Summed negative log-likelihood of `tokens[first_scored:]` given the tokens before them in this window, from
    one prefill of the window into the engine's KV cache blocks 0, 1, ..."""
    runner = engine.runner
    device = runner.device
    num_tokens = len(tokens)
    meta = AttentionMetadata.one_prefill(num_tokens, runner.block_size, device)
    input_ids = torch.tensor(tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    # Row i predicts token i + 1: the rows before the scored tokens are first_scored - 1 .. num_tokens - 2.
    rows = torch.arange(first_scored - 1, num_tokens - 1, dtype=torch.int64, device=device)
    hidden = runner.model(input_ids, positions, meta, rows)
    targets = input_ids[first_scored:]
    total = 0.0
    for start in range(0, hidden.shape[0], LOGITS_ROWS):
        logits = runner.model.compute_logits(hidden[start : start + LOGITS_ROWS]).float()
        log_probs = torch.log_softmax(logits, dim=-1)
        picked = log_probs.gather(1, targets[start : start + LOGITS_ROWS, None])
        total -= float(picked.sum())
    return total


# -- the start-up quality check ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityReport:
    setting: str  # e.g. "weights int4, KV int8"
    served: Perplexity
    reference: Perplexity  # float32 weights and KV cache, same tokens
    threshold: float  # the largest relative increase accepted

    @property
    def increase(self) -> float:
        """Relative perplexity increase of the served model over float32 (0.01 = +1%)."""
        return self.served.value / self.reference.value - 1.0

    @property
    def is_within_threshold(self) -> bool:
        return self.increase <= self.threshold


def quantized_setting(config: EngineConfig) -> tuple[str, float] | None:
    """(description, threshold) when `config` quantizes weights or the KV cache, else None. The threshold is the
    weights' (int8 +1%, int4 +5%), or int8's for an int8 KV cache alone."""
    parts = []
    if config.quantization != "none":
        parts.append(f"weights {config.quantization}")
    if config.kv_cache_dtype == "int8":
        parts.append("KV int8")
    if not parts:
        return None
    threshold = QUALITY_THRESHOLDS["int8" if config.quantization == "none" else config.quantization]
    return ", ".join(parts), threshold


def check_quality(
    engine: LLMEngine,
    load_reference: Callable[[], Checkpoint],
    *,
    num_tokens: int = CHECK_NUM_TOKENS,
) -> QualityReport | None:
    """The served model's perplexity on the evaluation text's first `num_tokens` tokens against float32 weights
    and KV cache (`load_reference()` returns the checkpoint loaded in float32, unquantized); logs a warning with
    both figures when the increase passes the setting's threshold (`QUALITY_THRESHOLDS`), else an info line.
    None when nothing is quantized or the engine has no tokenizer. The reference engine exists only during the
    check: it needs the float32 weights' memory once more, on the engine's device."""
    setting = quantized_setting(engine.engine_config)
    if setting is None:
        logger.info("quantization check: weights and KV cache are not quantized; nothing to check")
        return None
    tokenizer = engine.tokenizer
    if not isinstance(tokenizer, Tokenizer):  # None, or a decode-only stand-in
        logger.warning("quantization check skipped: the engine has no tokenizer to encode the evaluation text")
        return None
    description, threshold = setting
    started = time.perf_counter()
    tokens = tokenizer.encode(evaluation_text())[:num_tokens]
    # The same windows on both sides: one window of all the tokens unless the served engine holds fewer.
    window = min(len(tokens), engine.max_model_len, engine.capacity.num_tokens)
    served = perplexity(engine, tokens, window=window)
    reference_engine = _reference_engine(load_reference(), engine.engine_config, window)
    reference = perplexity(reference_engine, tokens, window=window)
    del reference_engine
    report = QualityReport(description, served, reference, threshold)
    log = logger.info if report.is_within_threshold else logger.warning
    log(
        "quantization check (%s): perplexity %.3f vs %.3f in float32 on the first %d tokens of the evaluation text, "
        "%+.2f%% (threshold +%.0f%%%s) in %.1f s",
        description,
        served.value,
        reference.value,
        served.num_tokens + 1,
        100 * report.increase,
        100 * threshold,
        "" if report.is_within_threshold else ": this model loses more than expected to quantization",
        time.perf_counter() - started,
    )
    return report


def _reference_engine(checkpoint: Checkpoint, config: EngineConfig, num_tokens: int) -> LLMEngine:
    """An engine over `checkpoint` in float32 with a float32 KV cache of just `num_tokens`, on `config`'s device."""
    model = ModelConfig.from_hf_config(checkpoint.hf_config)
    num_blocks = -(-num_tokens // config.block_size) + 1
    kv_bytes = num_blocks * config.block_size * model.kv_bytes_per_token("float32")
    reference = EngineConfig.of(config).model_copy(
        update={
            "dtype": "float32",
            "kv_cache_dtype": "auto",
            "quantization": "none",
            "kv_cache_memory": kv_bytes,
            "enforce_eager": True,
            "speculative": config.speculative.model_copy(update={"method": "off"}),
        }
    )
    return LLMEngine.from_checkpoint(checkpoint, reference)
