"""Per-request sampling parameters (OpenAI names plus vLLM's `ignore_eos` / `min_tokens` / `top_k` / `min_p`) and
the limits the engine enforces on them.

`SamplingParams` checks every field's type and range when it is built and raises `InvalidParamError` naming the
field, so a value that would fail inside the engine's step (a non-string stop, a seed torch cannot take, a top_k
that overflows a tensor) never reaches it. Limits that depend on the model (token ids below the vocabulary size)
are checked by `LLMEngine.validate`; a `top_k` above the vocabulary size means no top-k filtering.

`from_openai` builds the parameters from an OpenAI request body and names the request's own field on error; it
imports no torch, so the gateway can call it at its edge too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard, overload

from local_engine.errors import InvalidParamError

__all__ = [
    "GREEDY_TEMPERATURE",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_N",
    "MAX_SEED",
    "MAX_STOP_SEQUENCES",
    "MAX_STOP_SEQUENCE_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOP_LOGPROBS",
    "MIN_SEED",
    "SAMPLING_DEFAULT_FIELDS",
    "SamplingParams",
    "from_openai",
    "sampling_defaults",
]

MAX_N = 128  # choices per request
MAX_STOP_SEQUENCES = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_SEQUENCE_CHARS = 1024  # characters per stop string (matching costs the same at any length)
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


GREEDY_TEMPERATURE = 1e-5  # a temperature below this samples greedily


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off; above the vocabulary size = off too
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None = up to the model's maximum length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = the sampled token's logprob plus the top k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI `logit_bias`: (token id, bias in [-100, 100]) pairs added to the logits before sampling.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParamError naming the parameter and the allowed range."""
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, math.inf, "must be a finite number >= 0")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidParamError("top_p must be a number in (0, 1]", param="top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidParamError("top_k must be -1 or 0 (off) or a positive integer", param="top_k")
        _check_float("min_p", self.min_p, 0.0, 1.0, "must be a number in [0, 1]")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "must be a number in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "must be a number in [-2, 2]")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf):
            raise InvalidParamError("repetition_penalty must be a finite number > 0", param="repetition_penalty")
        if self.seed is not None:
            _check_int("seed", self.seed, MIN_SEED, MAX_SEED)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidParamError("max_tokens must be an integer >= 1", param="max_tokens")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or self.min_tokens > (self.max_tokens or math.inf):
            raise InvalidParamError("min_tokens must be an integer >= 0 and <= max_tokens", param="min_tokens")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidParamError(f"logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParamError(f"{name} must be true or false", param=name)
        self._validate_stop()
        self._validate_logit_bias()

    def _validate_stop(self) -> None:
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidParamError(f"stop must be a string or a list of at most {MAX_STOP_SEQUENCES}", param="stop")
        for stop in self.stop:
            if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_SEQUENCE_CHARS:
                raise InvalidParamError(
                    f"stop strings must be non-empty strings of at most {MAX_STOP_SEQUENCE_CHARS} characters",
                    param="stop",
                )
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or len(ids) > MAX_STOP_TOKEN_IDS or not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidParamError(
                f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids >= 0", param="stop_token_ids"
            )

    def _validate_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidParamError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
        for token_id, bias in self.logit_bias:
            if not _is_int(token_id) or token_id < 0:
                raise InvalidParamError(f"logit_bias keys must be token ids >= 0, got {token_id}", param="logit_bias")
            if not (_is_number(bias) and -100.0 <= bias <= 100.0):
                raise InvalidParamError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}", param="logit_bias"
                )

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one so small (below `GREEDY_TEMPERATURE`, as vLLM's sampling epsilon) that dividing
        by it overflows float32 logits: both mean the most likely token."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise InvalidParamError(f"{name} must be an integer between {low} and {high}", param=name)


def _check_float(name: str, value: object, low: float, high: float, rule: str) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (is_number and isinstance(value, int | float) and math.isfinite(value) and low <= value <= high):
        raise InvalidParamError(f"{name} {rule}", param=name)


# -- OpenAI request bodies ----------------------------------------------------------------------------------------


# What a deployment may set as its sampling defaults (vLLM reads the same from a model's generation_config.json).
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(values: Mapping[str, Any]) -> dict[str, float]:
    """`values` checked as sampling defaults: only `SAMPLING_DEFAULT_FIELDS`, each a valid value of that field.
    Raises InvalidParamError (a ValueError) naming the field."""
    unknown = sorted(set(values) - set(SAMPLING_DEFAULT_FIELDS))
    if unknown:
        raise InvalidParamError(
            f"sampling defaults take {', '.join(SAMPLING_DEFAULT_FIELDS)}; not {', '.join(map(str, unknown))}",
            param=str(unknown[0]),
        )
    checked: dict[str, float] = {}
    for name, value in values.items():
        if value is not None:
            checked[name] = _int_field(values, name, 0) if name == "top_k" else _float_field(values, name, 0.0)
    # (`checked` holds top_k's int among the floats: mypy reads every value as a float for every field)
    SamplingParams(**checked).validate()  # type: ignore[arg-type]
    return checked


def from_openai(
    body: Mapping[str, Any], *, is_chat: bool, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """Sampling parameters from an OpenAI chat (`is_chat`) or legacy completions body; a field the body leaves out
    (or sets to null) takes its value from `defaults` (checked by `sampling_defaults`), else OpenAI's default.

    JSON types are checked strictly (no strings for numbers, no booleans for integers; an integral float such as
    `2.0` counts as an integer). Raises InvalidParamError whose `param` is the request's own field name.
    """
    default = defaults or {}
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise InvalidParamError("best_of is not supported (use n)", param="best_of")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise InvalidParamError("response_format other than text is not supported", param="response_format")
    renamed: dict[str, str] = {}
    if is_chat:
        max_tokens_field = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
        max_tokens = _int_field(body, max_tokens_field)
        logprobs = _int_field(body, "top_logprobs", 0) if _bool_field(body, "logprobs", False) else None
        renamed = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"}
    else:
        max_tokens = _int_field(body, "max_tokens") if body.get("max_tokens") is not None else 16  # legacy default
        logprobs = _int_field(body, "logprobs")
    try:
        return SamplingParams(
            n=_int_field(body, "n", 1),
            temperature=_float_field(body, "temperature", default.get("temperature", 1.0)),
            top_p=_float_field(body, "top_p", default.get("top_p", 1.0)),
            top_k=_int_field(body, "top_k", int(default.get("top_k", 0))),
            min_p=_float_field(body, "min_p", default.get("min_p", 0.0)),
            presence_penalty=_float_field(body, "presence_penalty", 0.0),
            frequency_penalty=_float_field(body, "frequency_penalty", 0.0),
            repetition_penalty=_float_field(body, "repetition_penalty", default.get("repetition_penalty", 1.0)),
            seed=_int_field(body, "seed"),
            max_tokens=max_tokens,
            min_tokens=_int_field(body, "min_tokens", 0),
            stop=_stop(body.get("stop")),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            ignore_eos=_bool_field(body, "ignore_eos", False),
            logprobs=logprobs,
            skip_special_tokens=_bool_field(body, "skip_special_tokens", True),
            include_stop_str_in_output=_bool_field(body, "include_stop_str_in_output", False),
            logit_bias=_logit_bias(body.get("logit_bias")),
        )
    except InvalidParamError as exc:
        field = renamed.get(exc.param or "")
        if field is None:
            raise
        message = str(exc)
        message = field + message[len(exc.param or "") :] if message.startswith(f"{exc.param} ") else message
        raise InvalidParamError(message, param=field) from None


@overload
def _int_field(body: Mapping[str, Any], name: str) -> int | None: ...


@overload
def _int_field(body: Mapping[str, Any], name: str, default: int) -> int: ...


def _int_field(body: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not _is_int(value):
        raise InvalidParamError(f"{name} must be an integer, got {_describe(value)}", param=name)
    return value


def _float_field(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise InvalidParamError(f"{name} must be a finite number, got {_describe(value)}", param=name)
    return float(value)


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParamError(f"{name} must be true or false, got {_describe(value)}", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidParamError("stop must be a string or a list of strings", param="stop")
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidParamError(f"stop may hold at most {MAX_STOP_SEQUENCES} strings, got {len(value)}", param="stop")
    return tuple(value)


def _int_list(body: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise InvalidParamError(f"{name} must be a list of integers", param=name)
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` object (keys are strings in JSON) as sorted (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidParamError("logit_bias must be an object mapping token ids to biases", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParamError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidParamError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not _is_number(bias):
            raise InvalidParamError(
                f"logit_bias values must be numbers, got {_describe(bias)} for token {key}", param="logit_bias"
            )
        pairs.append((token_id, float(bias)))
    return tuple(sorted(pairs))


def _describe(value: Any) -> str:
    """A short, safe description of a bad value for an error message (never the whole value)."""
    if isinstance(value, bool | int | float):
        return repr(value) if len(repr(value)) <= 32 else type(value).__name__
    return f"a {type(value).__name__}" if not isinstance(value, str) else "a string"
