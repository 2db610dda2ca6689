"""The engine's own error tree (pure Python; the gateway translates it at one point, `backends/local.py`).

    LocalEngineError
    ├── CheckpointError                     a model, its weights or its tokenizer cannot be loaded; `code` says why
    ├── ModelLoadError (ValueError)         the engine cannot be built for this model with these settings
    ├── InvalidParamError (ValueError)      a request the engine refuses before queueing it; `param` names the field
    │   └── PromptTooLongError              the prompt (+ max_tokens) cannot fit the model's context or the KV cache
    ├── DuplicateRequestError (ValueError)  a request id that is already running
    ├── EngineBusyError (RuntimeError)      a call that needs an idle engine (perplexity) while requests run
    ├── RequestFailedError (RuntimeError)   processing ONE request failed; that request ends, the engine keeps going
    └── EngineDeadError (RuntimeError)      the step loop stopped (shut down, or it failed and could not restart)

These are the only errors the engine's entry points raise on purpose (`LLMEngine`, `AsyncEngine`, `load_checkpoint`,
`Tokenizer`, `perplexity`); builtin errors stay inside. The `ValueError` / `RuntimeError` bases keep callers that
catch those working. Errors raised inside pydantic validators (`config.py`) stay `ValueError`: pydantic turns them
into its `ValidationError` when the settings are built, before any engine exists.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DuplicateRequestError",
    "EngineBusyError",
    "EngineDeadError",
    "InvalidParamError",
    "LocalEngineError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestFailedError",
]


class LocalEngineError(Exception):
    """Root of every error the local engine raises on purpose."""


class CheckpointError(LocalEngineError):
    """A model that cannot be served: missing, truncated or unsupported files, no tokenizer. `code` is a stable
    name for the cause (`model_not_installed`, `checkpoint_corrupt`, `tokenizer_not_found`, ...)."""

    def __init__(self, message: str, *, code: str = "checkpoint_error") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ModelLoadError(LocalEngineError, ValueError):
    """An engine that cannot be built as asked: a model feature it does not implement (an architecture, rope
    scaling, activation), checkpoint tensors that do not fit the model, or settings this model or host cannot
    honour (an attention backend, a KV cache budget that holds no block, a draft model). Unlike `CheckpointError`
    it carries no code of its own: the gateway reports it as the load's failure."""


class InvalidParamError(LocalEngineError, ValueError):
    """A request field the engine cannot run with. `param` is the request field's name (OpenAI spelling), or
    None when the request as a whole is at fault; `code` names the refusal when it is more specific than
    `invalid_request` (e.g. `chat_template_missing`, `invalid_messages`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLongError(InvalidParamError):
    """A request that cannot fit even alone (prompt + max_tokens beyond the model length or the KV cache)."""


class DuplicateRequestError(LocalEngineError, ValueError):
    """A request added under an id that a running request already holds."""


class EngineBusyError(LocalEngineError, RuntimeError):
    """A call that runs in the engine's own KV cache (`perplexity`) made while requests are in the engine."""


class RequestFailedError(LocalEngineError, RuntimeError):
    """Processing one request raised inside the engine (stop strings, detokenizing, sampling); only that request
    failed and its KV blocks are freed."""


class EngineDeadError(LocalEngineError, RuntimeError):
    """The engine loop stopped (shut down, or a step failed and the engine could not restart)."""
