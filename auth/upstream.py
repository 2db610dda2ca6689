"""`RedisUpstreamLimiter`: the `UpstreamLimiter` of a gateway with Redis. Per deployment, at most `max_in_flight`
requests are in flight across every gateway instance; the rest wait in a cluster-wide FIFO.

`RedisAccess` builds one (`RedisAccess.upstream_limiter`) on its own Redis client, command pipe and script set,
and owns it (`RedisAccess.aclose()` closes it). The limiter reports its Redis failures through `StorageFailures`
(the access control's `FailurePolicy`), so one fast-fail window, one set of counters and one log cover the whole
connection: Redis down → the lease is granted without a cap (logged, counted as a limit bypass); Redis answering
as a read-only replica or with a redirection not followed to its end → 503 `limits_unavailable`; a script error →
500 `internal_error` (counted per script, never a bypass).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable
from typing import Any, Protocol

from redis.exceptions import MaxConnectionsError

from auth import redis_names, scripts
from auth.base import Priority, UpstreamLease
from auth.cluster_pipe import ClusterCommandPipe
from auth.keys import new_request_id
from auth.redis_client import RedisClient, blocking_client, disconnect_idle
from auth.resp_pipe import CommandPipe
from auth.scripts import DEFAULT_SCRIPTS, ScriptError, ScriptSet, StorageError, storage_errors
from gateway.errors import UnavailableError

__all__ = ["RedisUpstreamLimiter", "StorageFailures", "cancel_until_done"]

_POLL_S = 1.0  # a waiter re-checks this often even if no wake-up arrives (a lost hand-off)
_MAX_WAITERS = 1024  # blocking connections per instance; waiters beyond these poll every _POLL_S
_HANDOFF_TTL_MS = 5_000  # a slot handed to a waiter that never confirms it frees itself after this


class StorageFailures(Protocol):
    """Where the limiter reports what went wrong with Redis (`FailurePolicy`, shared with the access control)."""

    def check_redis_up(self) -> None:
        """Raise `StorageError` without asking Redis while it failed moments ago (the fast-fail window)."""
        ...

    async def note_failure(self, operation: str, exc: StorageError) -> None:
        """Count and log an outage, open the fast-fail window and drop idle connections."""
        ...

    def note_script_error(self, error: ScriptError, request_id: str) -> None:
        """Count a script error (a bug of ours) and log it once per script and line."""
        ...

    def note_bypass(self) -> None:
        """Count a request served without its limit checked."""
        ...


class RedisUpstreamLimiter:
    """`UpstreamLimiter` over Redis; see the module docstring."""

    def __init__(
        self,
        redis: RedisClient,
        pipe: CommandPipe | ClusterCommandPipe,
        *,
        failures: StorageFailures,
        lease_ttl_ms: int,
        script_set: ScriptSet = DEFAULT_SCRIPTS,
    ) -> None:
        self._pipe = pipe  # acquire / release, auto-pipelined with the access control's commands
        # BLPOP for wake-ups: a second client (one connection per waiter, so a large pool) whose read timeout
        # outlasts the blocking wait.
        self._blocking = blocking_client(redis, read_timeout_s=_POLL_S + 1.0, max_connections=_MAX_WAITERS)
        self._failures = failures
        self._scripts = script_set
        self._lease_ttl_ms = lease_ttl_ms
        self._background: set[asyncio.Task[None]] = set()

    async def acquire_upstream(
        self,
        deployment: str,
        *,
        max_in_flight: int,
        timeout_s: float,
        tenant: str = "",
        weight: float = 1.0,
        priority: Priority = "normal",
    ) -> UpstreamLease:
        """Wait in a cluster-wide FIFO for one of `max_in_flight` slots: woken by the releaser through a Redis list
        (BLPOP), re-checking every `_POLL_S` in case a wake-up was lost. Redis down → no cap (logged, counted)."""
        if max_in_flight <= 0:
            return UpstreamLease(deployment=deployment, lease_id=None)
        lease_id = new_request_id()
        entry = ""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        wake_key = redis_names.upstream_wake(deployment, lease_id)
        try:
            self._failures.check_redis_up()
            while True:
                is_held, entry = await scripts.acquire_upstream(
                    self._pipe,
                    deployment=deployment,
                    lease_id=lease_id,
                    max_in_flight=max_in_flight,
                    lease_ttl_ms=self._lease_ttl_ms,
                    wait_timeout_ms=int(timeout_s * 1000) + 1000,
                    queue_entry=entry,
                    scripts=self._scripts,
                )
                if is_held:
                    return UpstreamLease(deployment=deployment, lease_id=lease_id)
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    break
                await self._wait_for_wake(wake_key, max(min(remaining_s, _POLL_S), 0.01))
        except ScriptError as error:
            self._failures.note_script_error(error, lease_id)
            self._in_background(self._withdraw(deployment, lease_id, entry))
            raise
        except StorageError as exc:
            await self._failures.note_failure("acquire_upstream", exc)
            if not exc.is_outage:  # a redirection or a read-only replica answered: no cap is no answer
                self._in_background(self._withdraw(deployment, lease_id, entry))
                raise UnavailableError(
                    "The upstream's in-flight cap cannot be checked right now (the gateway's Redis is not writable "
                    "here). Retry in a few seconds.",
                    code="limits_unavailable",
                    headers={"retry-after": "1"},
                ) from exc
            self._failures.note_bypass()
            return UpstreamLease(deployment=deployment, lease_id=None)
        except asyncio.CancelledError:
            self._in_background(self._withdraw(deployment, lease_id, entry))
            raise
        await self._withdraw(deployment, lease_id, entry)
        raise UnavailableError(
            f"The upstream for this model is at capacity (max_in_flight={max_in_flight}) and no slot freed up "
            f"within {timeout_s:g} s. Retry shortly.",
            code="upstream_at_capacity",
            headers={"retry-after": "1"},
        )

    async def release_upstream(self, lease: UpstreamLease) -> None:
        if lease.lease_id is not None:
            await self._withdraw(lease.deployment, lease.lease_id, "")

    async def disconnect(self) -> None:
        """Drop the idle blocking connections (after a Redis failure each would fail once more)."""
        await disconnect_idle(self._blocking)

    async def aclose(self) -> None:
        """Cancel the withdrawals still running and close the blocking connections (the pipe is the owner's)."""
        await cancel_until_done(self._background, timeout_s=3.0)
        await self._blocking.aclose()

    async def _wait_for_wake(self, wake_key: str, timeout_s: float) -> None:
        try:
            async with storage_errors():
                await self._blocking.blpop([wake_key], timeout=timeout_s)
        except StorageError as exc:
            if not isinstance(exc.__cause__, MaxConnectionsError):
                raise
            await asyncio.sleep(timeout_s)  # more waiters than blocking connections: poll instead

    async def _withdraw(self, deployment: str, lease_id: str, entry: str) -> None:
        """Leave the queue; a slot handed over in the meantime passes on to the next waiter."""
        try:
            await scripts.release_upstream(
                self._pipe,
                deployment=deployment,
                lease_id=lease_id,
                queue_entry=entry,
                handoff_ttl_ms=_HANDOFF_TTL_MS,
                scripts=self._scripts,
            )
        except ScriptError as error:
            self._failures.note_script_error(error, lease_id)
        except StorageError as exc:
            await self._failures.note_failure("release_upstream", exc)

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def cancel_until_done(tasks: Iterable[asyncio.Task[None]], *, timeout_s: float) -> None:
    """Cancel `tasks` and wait up to `timeout_s` for them to end. redis-py can swallow a cancellation that lands
    while it connects, so cancel again until each task ends."""
    pending = set(tasks)
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
