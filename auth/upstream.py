"""`RedisUpstreamLimiter`: the `UpstreamLimiter` of a gateway with Redis. Per deployment, at most `max_in_flight`
requests are in flight across every gateway instance; the rest wait, cluster-wide, in fair order across tenants.

Fair order (auth/lua/acquire_upstream.lua, release_upstream.lua): each tenant (a team, else a key) waits in its
own FIFO line; a freed slot goes to the `priority` class high, then normal, then low, and within a class to the
tenant with the lowest virtual counter, which grows by 1 / `weight` with each slot the tenant is handed. A tenant
that starts waiting joins at the lowest counter of those already waiting, so time without waiters banks no credit,
and leaves (its counter with it) when its line empties: memory grows with the tenants waiting, not with all there
ever were. Waiters of a gateway before this order (one FIFO list) are served first and then never added to again.

`RedisAccess` builds one (`RedisAccess.upstream_limiter`) on its own Redis client, command pipe and script set,
and owns it (`RedisAccess.aclose()` closes it). The limiter reports its Redis failures through `StorageFailures`
(the access control's `FailurePolicy`), so one fast-fail window, one set of counters and one log cover the whole
connection: Redis down → the lease is granted without a cap (logged, counted as a limit bypass); Redis answering
as a read-only replica or with a redirection not followed to its end → 503 `limits_unavailable`; a script error →
500 `internal_error` (counted per script, never a bypass).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, get_args

from redis.asyncio import Redis, RedisCluster
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


_PRIORITIES: tuple[Priority, ...] = get_args(Priority)
_MIN_WEIGHT, _MAX_WEIGHT = 1e-3, 1e3  # a weight outside these (or not a number) is clamped; 0 would divide by 0


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a waiter waits: its tenant's line in its priority class, and the weight its hand-offs count with."""

    tenant: str
    weight: float
    priority: Priority


_NO_PLACE = _Place("", 1.0, "normal")  # a release that leaves no line


def _valid_weight(weight: float) -> float:
    if not math.isfinite(weight):
        return 1.0
    return min(max(weight, _MIN_WEIGHT), _MAX_WEIGHT)


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
        self._is_blocking_ready = isinstance(self._blocking, Redis)  # a cluster client reads its slot map first
        self._blocking_lock = asyncio.Lock()
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
        """Wait in `tenant`'s line for one of `max_in_flight` slots, served in fair order (the module docstring):
        woken by the releaser through a Redis list (BLPOP), re-checking every `_POLL_S` in case a wake-up was lost.
        Redis down → no cap (logged, counted)."""
        if max_in_flight <= 0:
            return UpstreamLease(deployment=deployment, lease_id=None)
        place = _Place(tenant, _valid_weight(weight), priority if priority in _PRIORITIES else "normal")
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
                    handoff_ttl_ms=_HANDOFF_TTL_MS,
                    tenant=place.tenant,
                    weight=place.weight,
                    priority=place.priority,
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
            self._in_background(self._withdraw(deployment, lease_id, entry, place))
            raise
        except StorageError as exc:
            await self._failures.note_failure("acquire_upstream", exc)
            if not exc.is_outage:  # a redirection or a read-only replica answered: no cap is no answer
                self._in_background(self._withdraw(deployment, lease_id, entry, place))
                raise UnavailableError(
                    "The upstream's in-flight cap cannot be checked right now (the gateway's Redis is not writable "
                    "here). Retry in a few seconds.",
                    code="limits_unavailable",
                    headers={"retry-after": "1"},
                ) from exc
            self._failures.note_bypass()
            return UpstreamLease(deployment=deployment, lease_id=None)
        except asyncio.CancelledError:
            self._in_background(self._withdraw(deployment, lease_id, entry, place))
            raise
        await self._withdraw(deployment, lease_id, entry, place)
        raise UnavailableError(
            f"The upstream for this model is at capacity (max_in_flight={max_in_flight}) and no slot freed up "
            f"within {timeout_s:g} s. Retry shortly.",
            code="upstream_at_capacity",
            headers={"retry-after": "1"},
        )

    async def release_upstream(self, lease: UpstreamLease) -> None:
        if lease.lease_id is not None:
            await self._withdraw(lease.deployment, lease.lease_id, "", _NO_PLACE)

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
                if not self._is_blocking_ready:
                    await self._read_slot_map()
                await self._blocking.blpop([wake_key], timeout=timeout_s)
        except StorageError as exc:
            if not isinstance(exc.__cause__, MaxConnectionsError):
                self._is_blocking_ready = isinstance(self._blocking, Redis)
                raise
            await asyncio.sleep(timeout_s)  # more waiters than blocking connections: poll instead

    async def _read_slot_map(self) -> None:
        """Read the blocking cluster client's slot map once, before its BLPOPs (and again after a failure): a
        client that has not read it sends its first commands to any node, and a crowd of waiters that all get MOVED
        at once makes redis-py close every connection, cutting every other waiter's BLPOP too."""
        async with self._blocking_lock:
            if not self._is_blocking_ready and isinstance(self._blocking, RedisCluster):
                await self._blocking.initialize()
            self._is_blocking_ready = True

    async def _withdraw(self, deployment: str, lease_id: str, entry: str, place: _Place) -> None:
        """Leave the line (free the slot); a slot handed over in the meantime passes on to the next waiter."""
        try:
            await scripts.release_upstream(
                self._pipe,
                deployment=deployment,
                lease_id=lease_id,
                queue_entry=entry,
                handoff_ttl_ms=_HANDOFF_TTL_MS,
                tenant=place.tenant,
                priority=place.priority,
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
