"""The engine's own error tree (pure Python; the gateway translates it at one point, `backends/local.py`).

    LocalEngineError
    ├── InvalidParamError (ValueError)    a request the engine refuses before queueing it; `param` names the field
    │   └── PromptTooLongError            the prompt (+ max_tokens) cannot fit the model's context or the KV cache
    ├── RequestFailedError (RuntimeError) processing ONE request failed; that request ends, the engine keeps going
    └── EngineDeadError (RuntimeError)    the step loop stopped (shut down, or it failed and could not restart)

The `ValueError` / `RuntimeError` bases keep older callers that catch those working.
"""

from __future__ import annotations

__all__ = ["EngineDeadError", "InvalidParamError", "LocalEngineError", "PromptTooLongError", "RequestFailedError"]


class LocalEngineError(Exception):
    """Root of every error the local engine raises on purpose."""


class InvalidParamError(LocalEngineError, ValueError):
    """A request field the engine cannot run with. `param` is the request field's name (OpenAI spelling), or
    None when the request as a whole is at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidParamError):
    """A request that cannot fit even alone (prompt + max_tokens beyond the model length or the KV cache)."""


class RequestFailedError(LocalEngineError, RuntimeError):
    """Processing one request raised inside the engine (stop strings, detokenizing, sampling); only that request
    failed and its KV blocks are freed."""


class EngineDeadError(LocalEngineError, RuntimeError):
    """The engine loop stopped (shut down, or a step failed and the engine could not restart)."""
