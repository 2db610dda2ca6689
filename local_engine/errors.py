"""The engine's own error tree (pure Python; the gateway translates it at one point, `backends/local.py`).

    LocalEngineError
    ├── CheckpointError                   a model, its weights or its tokenizer cannot be loaded; `code` says why
    ├── InvalidParamError (ValueError)    a request the engine refuses before queueing it; `param` names the field
    │   └── PromptTooLongError            the prompt (+ max_tokens) cannot fit the model's context or the KV cache
    ├── RequestFailedError (RuntimeError) processing ONE request failed; that request ends, the engine keeps going
    └── EngineDeadError (RuntimeError)    the step loop stopped (shut down, or it failed and could not restart)

The `ValueError` / `RuntimeError` bases keep older callers that catch those working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "EngineDeadError",
    "InvalidParamError",
    "LocalEngineError",
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


class RequestFailedError(LocalEngineError, RuntimeError):
    """Processing one request raised inside the engine (stop strings, detokenizing, sampling); only that request
    failed and its KV blocks are freed."""


class EngineDeadError(LocalEngineError, RuntimeError):
    """The engine loop stopped (shut down, or a step failed and the engine could not restart)."""
