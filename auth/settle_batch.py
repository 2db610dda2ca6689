"""Settles on the command pipe, batched per key: the settles of one key queued before the pipe writes its next batch
share one `settle_request` script call, so the record and usage updates cost Redis once per batch (at c=32 on one
key that halved Redis' time per request). A request admitted with its key's team is settled twice with the same
usage, on the key and on the team (the team's state under its own names, the same script, idempotent per request
id on each), both queued before `begin` returns, so they go out in the same pipelined write. A settle never fails
for Redis: one Redis could not take is kept by `SettleRetries` (auth/settle_retry.py) and sent again once Redis
answers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError, RedisError
from redis.typing import EncodableT

from auth import redis_names, scripts
from auth.base import Admission, SettleUsage
from auth.cluster_pipe import ClusterCommandPipe
from auth.failure_policy import FailurePolicy
from auth.keys import new_request_id
from auth.resp_pipe import CommandPipe
from auth.scripts import ScriptError, ScriptSet, StorageError
from auth.settle_retry import SettleRetries

__all__ = ["SettleBatcher"]

_MARKER_TTL_MS = 120_000  # a retried settle within 2 min is a no-op (one small key per request, so keep it short)
_USAGE_RETENTION_S = 400 * 86_400
_MAX_SETTLE_BATCH = 128  # requests per settle script call (it runs atomically, so keep each call short)


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def _both(first: asyncio.Future[None], second: asyncio.Future[None]) -> asyncio.Future[None]:
    """Done when both are (lighter than `asyncio.gather`; neither ever fails)."""
    both = first.get_loop().create_future()

    def on_done(_: asyncio.Future[None]) -> None:
        if first.done() and second.done() and not both.done():
            both.set_result(None)

    first.add_done_callback(on_done)
    second.add_done_callback(on_done)
    return both


@dataclass(slots=True)
class _SettleBatch:
    """Settles of one key queued on the command pipe as one script call, open to more until it is written."""

    key_id: str
    items: list[scripts.SettleItem] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # the gateway's request ids, for logs
    futures: list[asyncio.Future[None]] = field(default_factory=list)


class SettleBatcher:
    """`begin(admission, usage)` queues a settle; `aclose()` sends what is queued and drops what is kept."""

    def __init__(
        self,
        pipe: CommandPipe | ClusterCommandPipe,
        *,
        failures: FailurePolicy,
        window_ms: int,
        script_set: ScriptSet,
    ) -> None:
        self._pipe = pipe
        self._failures = failures
        self._window_ms = window_ms
        self._scripts = script_set
        self._open: dict[str, _SettleBatch] = {}  # by key id: the batch later settles of that key join
        self._settling: set[asyncio.Task[None]] = set()
        # Settles Redis could not take, sent again once it answers (their leases would otherwise be held to TTL).
        self._retries = SettleRetries(self._resend, is_down=failures.is_down)

    def begin(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        """Queue the settle on the command pipe before returning (see `AccessControl.begin_settle`)."""
        if admission.is_settled:
            return _done()
        admission.is_settled = True
        key_id = admission.principal.key_id or redis_names.MASTER_ID
        request_id = admission.lease_id or new_request_id()
        item = scripts.SettleItem(
            request_id=request_id,
            reserved_tokens=admission.reserved_tokens,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            model=admission.model,
            cost_micros=usage.cost_micros,
            is_priced=usage.is_priced,
            budget_tokens=admission.budget_tokens,
            reserved_micros=admission.reserved_micros,
            is_estimated=usage.is_estimated,
        )
        settles = [(key_id, item)]
        if admission.team_id is not None:
            team_item = scripts.SettleItem(
                request_id,
                item.reserved_tokens,
                item.prompt_tokens,
                item.completion_tokens,
                item.model,
                item.cost_micros,
                item.is_priced,
                item.budget_tokens,
                admission.team_reserved_micros,
                item.is_estimated,
            )
            settles.append((redis_names.team_state_id(admission.team_id), team_item))
        if self._failures.is_down():  # known down: keep them for when Redis answers again
            for state_id, queued in settles:
                self._retries.keep(state_id, [queued])
            return _done()
        if len(settles) == 1:
            return self._queue(key_id, item, admission.request_id)
        return _both(*(self._queue(state_id, queued, admission.request_id) for state_id, queued in settles))

    def _queue(self, state_id: str, item: scripts.SettleItem, request_id: str) -> asyncio.Future[None]:
        """Add one settle to the open batch of its state id (a key's id or a team's), opening one if needed."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch = self._open.get(state_id)
        if batch is None or len(batch.items) >= _MAX_SETTLE_BATCH:
            self._open[state_id] = batch = _SettleBatch(state_id)
            build = functools.partial(self._settle_command, batch)
            reply = self._pipe.submit(build, key=redis_names.state_record(state_id))
            task = asyncio.ensure_future(self._finish(batch, reply))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        batch.items.append(item)
        batch.request_ids.append(request_id)
        batch.futures.append(future)
        return future

    async def aclose(self) -> None:
        if self._settling:  # settles already queued are sent, not dropped (each is bounded by the socket timeout)
            await asyncio.wait(set(self._settling), timeout=5.0)
        await self._retries.aclose()

    async def _resend(self, key_id: str, items: list[scripts.SettleItem]) -> None:
        """Send settles kept by `SettleRetries` (idempotent: one that did reach Redis changes nothing); raises
        `StorageError` while Redis is still unavailable. A script error drops them, counted like any other."""
        for start in range(0, len(items), _MAX_SETTLE_BATCH):
            try:
                try:
                    await self._settle_now(key_id, items[start : start + _MAX_SETTLE_BATCH])
                except (TimeoutError, RedisError, OSError) as exc:
                    raise scripts.classify_failure(exc, self._scripts.settle) from exc
            except ScriptError as error:
                self._failures.note_script_error(error, key_id)
            except StorageError as exc:
                await self._failures.note_failure("settle", exc)
                raise

    def _close(self, batch: _SettleBatch) -> None:
        if self._open.get(batch.key_id) is batch:
            del self._open[batch.key_id]

    def _settle_command(self, batch: _SettleBatch) -> tuple[EncodableT, ...]:
        """Called by the pipe as it writes the batch: later settles start a new one."""
        self._close(batch)
        return scripts.settle_command(
            key_id=batch.key_id,
            items=batch.items,
            window_ms=self._window_ms,
            marker_ttl_ms=_MARKER_TTL_MS,
            usage_retention_s=_USAGE_RETENTION_S,
            scripts=self._scripts,
        )

    async def _finish(self, batch: _SettleBatch, reply: asyncio.Future[Any]) -> None:
        try:
            try:
                try:
                    scripts.settled_flags(await reply, self._scripts)
                except NoScriptError:  # Redis restarted or was flushed: register and send the batch again
                    await self._settle_now(batch.key_id, batch.items)
                except (TimeoutError, RedisError, OSError) as exc:
                    raise scripts.classify_failure(exc, self._scripts.settle) from exc
            except ScriptError as error:
                self._failures.note_script_error(error, ",".join(filter(None, batch.request_ids)) or batch.key_id)
            except StorageError as exc:
                await self._failures.note_failure("settle", exc)
                self._retries.keep(batch.key_id, batch.items)
        finally:
            self._close(batch)  # the pipe failed before writing it: nothing more may join
            for future in batch.futures:
                if not future.done():
                    future.set_result(None)

    async def _settle_now(self, key_id: str, items: Sequence[scripts.SettleItem]) -> None:
        """One script call settling `items` of one key, outside the batching pipe's queue."""
        await scripts.settle_requests(
            self._pipe,
            key_id=key_id,
            items=items,
            window_ms=self._window_ms,
            marker_ttl_ms=_MARKER_TTL_MS,
            usage_retention_s=_USAGE_RETENTION_S,
            scripts=self._scripts,
        )
