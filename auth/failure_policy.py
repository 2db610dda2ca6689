"""What happens when Redis fails: the failure mode, the fast-fail window, and the counters and logs of failures.

`StorageError` (unreachable, timed out, or refusing for its own state): `failure_mode` (`UNIGATE_REDIS_FAILURE_MODE`)
decides. `closed` → 503 `limits_unavailable` except for keys verified within the cache lifetime; `open` → serve
every key this instance has verified before, without limits (an unknown key still cannot be verified, so it still
gets 503). Every bypass is logged and counted. Nothing waits on a dead Redis for longer than the client's socket
timeout, and after one failure the next `_FAST_FAIL_S` skip Redis entirely. A Redis that answers but not as the
store it should be (a read-only replica, a cluster redirection not followed to its end: `StorageError.is_outage`
False) is no outage: 503 for every key, never a bypass, whatever the failure mode.

A script that raises (`ScriptError`) is a bug of ours, not an outage: it is logged once per script and line,
counted per script (`num_script_errors`), and never opens the fast-fail window or bypasses a limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from auth.base import Principal, model_allowed
from auth.key_cache import CachedKey
from auth.scripts import ScriptError, StorageError
from gateway.errors import PermissionDeniedError, UnavailableError

__all__ = ["FailurePolicy"]

logger = logging.getLogger("unigate.auth")

_FAST_FAIL_S = 0.5  # after a failure, skip Redis this long instead of paying a timeout on every request


class _FastFailError(StorageError):
    """Redis was not asked: it failed less than `_FAST_FAIL_S` ago."""


class FailurePolicy:
    """One fast-fail window, one set of counters and one log for every user of a Redis connection (the access
    control, its settles and its `RedisUpstreamLimiter`, whose `StorageFailures` this is). `disconnect` drops the
    connection's idle pooled sockets after a failure."""

    def __init__(self, *, failure_mode: Literal["closed", "open"], disconnect: Callable[[], Awaitable[None]]) -> None:
        self._is_fail_open = failure_mode == "open"
        self._disconnect = disconnect
        self._down_until = 0.0
        self._is_down_an_outage = True  # what the last failure was (see `StorageError.is_outage`)
        self._logged_script_errors: set[tuple[str, int]] = set()
        # Counters for the app's metrics registry (gateway/metrics exports them; no global registry here).
        self.num_storage_errors = 0
        self.num_limit_bypasses = 0
        self.num_script_errors: dict[str, int] = {}  # per script name

    def is_down(self) -> bool:
        """Within the fast-fail window: Redis failed moments ago."""
        return time.monotonic() < self._down_until

    def check_redis_up(self) -> None:
        """Raise `StorageError` without asking Redis while it failed moments ago."""
        if time.monotonic() < self._down_until:
            error = _FastFailError("Redis failed moments ago; not retrying yet.", headers={"retry-after": "1"})
            error.is_outage = self._is_down_an_outage
            raise error

    async def note_failure(self, operation: str, exc: StorageError) -> None:
        """Count and log a failure, fail fast for a moment, and drop idle pooled connections: after a Redis restart
        each of them would fail once more, so recovery would be slow and ragged without this."""
        if isinstance(exc, _FastFailError):
            return  # not a new failure: Redis was not asked
        self.num_storage_errors += 1
        self._is_down_an_outage = exc.is_outage
        if time.monotonic() >= self._down_until:
            logger.warning(
                "Redis unavailable during %s; failure mode %s", operation, "open" if self._is_fail_open else "closed"
            )
        self._down_until = time.monotonic() + _FAST_FAIL_S
        await self._disconnect()

    def note_script_error(self, error: ScriptError, request_id: str) -> None:
        """Count a script error and log it the first time its script and line fail (the detail names both)."""
        self.num_script_errors[error.script] = self.num_script_errors.get(error.script, 0) + 1
        where = (error.script, error.line)
        if where not in self._logged_script_errors:
            self._logged_script_errors.add(where)
            logger.error(
                "Lua script %s failed at line %d (request %s): %s", error.script, error.line, request_id, error.detail
            )

    def note_bypass(self) -> None:
        self.num_limit_bypasses += 1

    def without_redis(
        self, cached: CachedKey | None, model: str | None, failure: StorageError, *, is_fresh: bool
    ) -> Principal:
        """The principal to serve without Redis (`is_fresh`: `cached` was verified within the cache lifetime), or
        503 `limits_unavailable` when the failure mode forbids it or Redis did not fail at all (a redirection or a
        read-only replica answered: see `StorageError.is_outage`)."""
        if failure.is_outage and cached is not None and (self._is_fail_open or is_fresh):
            cached.check()
            if model is not None and not model_allowed(cached.principal.models, model):
                raise PermissionDeniedError(
                    f"This API key may not use model '{model}'. Ask the gateway admin to add it.",
                    code="model_not_allowed",
                    param="model",
                )
            self.num_limit_bypasses += 1
            return cached.principal
        raise UnavailableError(
            "Rate limits cannot be checked right now (the gateway's Redis is unavailable), so this key cannot be "
            "verified. Retry in a few seconds.",
            code="limits_unavailable",
            headers={"retry-after": "1"},
        )
