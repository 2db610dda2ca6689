"""`SettleRetries`: kept settles are sent once Redis answers, each once, in bounded memory and time."""

from __future__ import annotations

import asyncio

import pytest

from auth import settle_retry
from auth.scripts import SettleItem, StorageError
from auth.settle_retry import SettleRetries


def items(*ids: str) -> list[SettleItem]:
    return [SettleItem(i, 0, 1, 1, "m", 0, False) for i in ids]


async def test_kept_settles_are_sent_once_when_redis_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settle_retry, "RETRY_INTERVAL_S", 0.01)
    sent: list[tuple[str, list[str]]] = []
    failures = [StorageError("down"), StorageError("down")]

    async def send(key_id: str, batch: list[SettleItem]) -> None:
        if failures:
            raise failures.pop()
        sent.append((key_id, [item.request_id for item in batch]))

    retries = SettleRetries(send, is_down=lambda: False)
    retries.keep("k1", items("a", "b"))
    retries.keep("k2", items("c"))
    for _ in range(100):
        if not len(retries):
            break
        await asyncio.sleep(0.01)
    assert sorted(sent) == [("k1", ["a", "b"]), ("k2", ["c"])] and retries.num_dropped == 0


async def test_memory_and_time_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settle_retry, "RETRY_INTERVAL_S", 0.01)
    monkeypatch.setattr(settle_retry, "RETRY_FOR_S", 0.05)  # (the real one stays within the 120 s marker)
    monkeypatch.setattr(settle_retry, "MAX_KEPT", 3)

    async def send(key_id: str, batch: list[SettleItem]) -> None:
        raise AssertionError("Redis is down: nothing is sent")

    retries = SettleRetries(send, is_down=lambda: True)
    retries.keep("k", items("a", "b", "c", "d", "e"))
    assert (len(retries), retries.num_dropped) == (3, 2)
    await asyncio.sleep(0.2)
    assert (len(retries), retries.num_dropped) == (0, 5)
    await retries.aclose()


def test_retries_end_before_the_settle_markers_do() -> None:
    """A settle that reached Redis before its reply was lost must not count twice: retries stop in time."""
    from auth.settle_batch import _MARKER_TTL_MS

    assert settle_retry.RETRY_FOR_S + 2 * settle_retry.RETRY_INTERVAL_S < _MARKER_TTL_MS / 1000
