"""Waiters across tenants in fair order (`FairQueue`): the order in which auth/lua/_fair_handoff.lua hands out an
upstream's `max_in_flight` slots, in process. gateway/slo_admission.py queues for its deployments' limits in it."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["FairQueue", "QueueEntry"]

_PRIORITY_RANKS = {"high": 0, "normal": 1, "low": 2}

T = TypeVar("T")


@dataclass(slots=True)
class QueueEntry(Generic[T]):
    item: T
    tenant: str
    weight: float
    rank: int
    seq: int
    is_queued: bool = True


class FairQueue(Generic[T]):
    """Waiters across tenants in fair order: the best priority class first; within a class the tenant with the
    lowest virtual counter (each waiter served adds 1 / its weight; ties: the earliest waiting); FIFO within a
    tenant. A tenant whose last waiter leaves drops out and its counter with it (idle time banks no credit); one
    that joins starts at the lowest counter of its class."""

    def __init__(self) -> None:
        self._lines: list[dict[str, deque[QueueEntry[T]]]] = [{} for _ in _PRIORITY_RANKS]
        self._counters: list[dict[str, float]] = [{} for _ in _PRIORITY_RANKS]
        self._seq = itertools.count()
        self._num_queued = 0

    def __len__(self) -> int:
        return self._num_queued

    def push(self, item: T, tenant: str = "", weight: float = 1.0, priority: str = "normal") -> QueueEntry[T]:
        rank = _PRIORITY_RANKS.get(priority, 1)
        lines, counters = self._lines[rank], self._counters[rank]
        line = lines.get(tenant)
        if line is None:
            line = lines[tenant] = deque()
            counters[tenant] = min(counters.values(), default=0.0)
        entry = QueueEntry(item, tenant, weight if weight > 0 else 1.0, rank, next(self._seq))
        line.append(entry)
        self._num_queued += 1
        return entry

    def pop(self) -> T | None:
        """The next waiter in fair order, taken out; None when none waits."""
        for lines, counters in zip(self._lines, self._counters, strict=True):
            if not lines:
                continue
            tenant = min(lines, key=lambda t: (counters[t], lines[t][0].seq))
            line = lines[tenant]
            entry = line.popleft()
            entry.is_queued = False
            self._num_queued -= 1
            if line:
                counters[tenant] += 1.0 / entry.weight
            else:
                del lines[tenant], counters[tenant]
            return entry.item
        return None

    def remove(self, entry: QueueEntry[T]) -> bool:
        """Take a waiter out (its deadline passed, or it left); False when it was already served."""
        if not entry.is_queued:
            return False
        entry.is_queued = False
        self._num_queued -= 1
        lines = self._lines[entry.rank]
        line = lines[entry.tenant]
        line.remove(entry)
        if not line:
            del lines[entry.tenant], self._counters[entry.rank][entry.tenant]
        return True
