"""Settles that Redis could not take, sent again once it answers.

A settle lost to a short outage (Redis restarting, paused, failing over) would leave its concurrency lease held
until the lease's TTL (10 minutes by default: a `max_concurrent` key locked out) and its usage uncounted. Kept
here instead, in memory and bounded, it is sent again every `RETRY_INTERVAL_S` while Redis is up, for at most
`RETRY_FOR_S` after it failed: within the settle script's 120 s idempotency marker, so a settle that did reach
Redis before its reply was lost is not counted twice. What is still unsent then is dropped and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from auth.scripts import SettleItem, StorageError

__all__ = ["MAX_KEPT", "RETRY_FOR_S", "RETRY_INTERVAL_S", "SettleRetries"]

logger = logging.getLogger("unigate.auth")

RETRY_INTERVAL_S = 0.5
RETRY_FOR_S = 100.0  # < the 120 s marker TTL of settle_request.lua
MAX_KEPT = 10_000  # settles held at once (a few hundred bytes each); beyond, a new one is dropped and counted


class SettleRetries:
    """`keep(key_id, items)` after a failed settle; `send(key_id, items)` sends one key's batch (raising
    `StorageError` while Redis is unavailable); `is_down()` says whether to wait before trying."""

    def __init__(
        self, send: Callable[[str, list[SettleItem]], Awaitable[None]], *, is_down: Callable[[], bool]
    ) -> None:
        self._send = send
        self._is_down = is_down
        self._kept: list[tuple[float, str, SettleItem]] = []  # (give up at, key id, item), oldest first
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key_id: str, items: list[SettleItem]) -> None:
        room = max(0, MAX_KEPT - len(self._kept))
        give_up_at = time.monotonic() + RETRY_FOR_S
        self._kept.extend((give_up_at, key_id, item) for item in items[:room])
        self._drop(len(items) - min(room, len(items)), "too many are waiting")
        if self._kept and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="unigate-settle-retries")

    async def aclose(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._drop(len(self._kept), "the gateway is stopping")
        self._kept = []

    async def _run(self) -> None:
        while self._kept:
            await asyncio.sleep(RETRY_INTERVAL_S)
            now = time.monotonic()
            expired = sum(1 for give_up_at, _, _ in self._kept if give_up_at <= now)
            self._kept = [entry for entry in self._kept if entry[0] > now]
            self._drop(expired, f"Redis did not take them within {RETRY_FOR_S:g} s")
            if self._is_down() or not self._kept:
                continue
            kept, self._kept = self._kept, []
            by_key: dict[str, list[tuple[float, str, SettleItem]]] = {}
            for entry in kept:
                by_key.setdefault(entry[1], []).append(entry)
            for position, (key_id, entries) in enumerate(by_key.items()):
                try:
                    await self._send(key_id, [item for _, _, item in entries])
                except StorageError:  # still unavailable: keep this key's and the remaining keys' settles
                    self._kept = [e for rest in list(by_key.values())[position:] for e in rest] + self._kept
                    break

    def _drop(self, num: int, why: str) -> None:
        if num > 0:
            self.num_dropped += num
            logger.warning("dropped %d settles that Redis could not take (%s); their leases expire by TTL", num, why)
