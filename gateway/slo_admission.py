"""SLO-aware admission: per deployment of a model with `slo:`, a live limit on its requests in flight from this
gateway, adapted to the SLO it meets, and a bounded fair queue in front of it with a deadline.

    slo = DeploymentSlo(config.slo, seed=8)          # one per deployment (gateway/router.py builds them)
    ticket = await slo.admit(principal)              # waits in the queue; OverloadedError (503) when shed
    ...                                              # the attempt runs
    slo.release(ticket, ttft_s=0.21, tpot_s=0.03)    # its latency feeds the window; the next waiter starts

- **The window.** Each finished attempt leaves its TTFT (streams: until the first chunk; a non-streamed answer: the
  whole answer, so TTFT = E2E) and TPOT (streams only: the time from the first to the last chunk over the tokens
  after the first) in a sliding window of the `WINDOW_REQUESTS` most recent, whose p50 and p95 are shown. Failed
  attempts free their place without a sample.
- **The limit (AIMD).** Every `max(MIN_EPOCH_REQUESTS, limit)` samples of requests admitted under the current limit
  make an epoch (`limit` samples in slow start). An epoch whose p95 TTFT or p95 TPOT is above the SLO multiplies the
  limit by `DECREASE_FACTOR` (rounded down, at least 1) and starts a new generation: the requests still running from
  before the decrease do not judge the new limit. An epoch that meets the SLO while the limit was reached adds one
  (up to `slo.max_limit`).
  Without a seed the limit starts at 1 and doubles per good epoch (slow start) until an epoch's p95 passes
  `SLOW_START_EXIT` of the SLO's, or breaks it.
- **The queue.** A request that finds the deployment at its limit waits, in the tenants' fair order (`FairQueue`:
  priority class first, then the tenant served fewest times per unit of weight, FIFO within a tenant: the order of
  auth/lua/_fair_handoff.lua), at most `slo.max_wait_s`; a freed place is handed to the next waiter at once, so
  a newcomer never overtakes a waiter. One that cannot start within its deadline, or finds `slo.max_queue` waiting,
  is shed with 503 `overloaded` and a `Retry-After`.

All of it is per gateway instance, in memory: N instances admit up to N times a deployment's limit between them,
each measuring the latency its own requests see.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.base import Json, ReportsStreamUsage
from gateway.errors import OverloadedError
from gateway.fair_queue import FairQueue, QueueEntry
from gateway.routing_config import SloConfig

__all__ = [
    "DECREASE_FACTOR",
    "MIN_EPOCH_REQUESTS",
    "SLOW_START_EXIT",
    "WINDOW_REQUESTS",
    "DeploymentSlo",
    "SloTicket",
    "TenantLike",
    "TimedStream",
    "percentile",
    "slo_states",
    "with_room",
]

DECREASE_FACTOR = 0.7  # the limit after an epoch that broke the SLO, times the limit before
SLOW_START_EXIT = 0.8  # slow start ends at an epoch whose p95 is above this share of the SLO's
MIN_EPOCH_REQUESTS = 8  # the fewest samples that judge a limit
WINDOW_REQUESTS = 100  # the sliding window's length (the p50 / p95 shown)


class TenantLike(Protocol):
    """Whose request waits (`auth.base.Principal` is one): its tenant, weight and priority class."""

    @property
    def tenant(self) -> str: ...

    @property
    def weight(self) -> float: ...

    @property
    def priority(self) -> str: ...


@dataclass(frozen=True, slots=True)
class SloTicket:
    """An admitted request's place: the generation of the limit it was admitted under."""

    generation: int


@dataclass(slots=True)
class _Waiter:
    future: asyncio.Future[SloTicket]
    enqueued_at: float
    entry: QueueEntry[_Waiter] | None = None
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Epoch:
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    num_samples: int = 0
    peak_admitted: int = 0  # the most requests in flight while it ran


class DeploymentSlo:
    """One deployment's live limit, window and queue (see the module docstring)."""

    def __init__(
        self,
        config: SloConfig,
        seed: int | None = None,
        *,
        name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = name
        self.limit = min(seed, config.max_limit) if seed is not None else 1
        self.is_slow_start = seed is None
        self.num_admitted = 0
        self.generation = 0
        self.num_shed = 0
        self.max_admitted_wait_s = 0.0  # the longest any admitted request waited in the queue
        self.num_decreases = 0
        self.num_increases = 0
        self._queue: FairQueue[_Waiter] = FairQueue()
        self._window: deque[tuple[float | None, float | None]] = deque(maxlen=WINDOW_REQUESTS)
        self._epoch = _Epoch()
        self._clock = clock

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def epoch_size(self) -> int:
        """The samples that judge the current limit: one round of it in slow start (it doubles once per round, as
        TCP's window does per round trip), else at least `MIN_EPOCH_REQUESTS`."""
        return self.limit if self.is_slow_start else max(MIN_EPOCH_REQUESTS, self.limit)

    @property
    def has_room(self) -> bool:
        return self.num_admitted < self.limit and not self._queue

    async def admit(self, tenant: TenantLike) -> SloTicket:
        """A place under the limit: at once when there is room and nobody waits, else after a wait in the fair
        queue; `OverloadedError` when the queue is full or the deadline passes first."""
        if self.has_room:
            return self._take()
        if len(self._queue) >= self.config.max_queue:
            raise self._shed("its queue is full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), self._clock())
        waiter.entry = self._queue.push(waiter, tenant.tenant, tenant.weight, tenant.priority)
        waiter.timer = loop.call_later(self.config.max_wait_s, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._leave(waiter)
            raise

    def release(self, ticket: SloTicket, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        """An admitted request finished (`ttft_s` None: it failed, no sample); the next waiters start."""
        self.num_admitted -= 1
        if ttft_s is not None or tpot_s is not None:
            self._window.append((ttft_s, tpot_s))
            if ticket.generation == self.generation:
                self._sample(ttft_s, tpot_s)
        self._hand_off()

    def state(self) -> dict[str, Any]:
        """What /admin/models and the Prometheus gauges show."""
        ttfts = sorted(t for t, _ in self._window if t is not None)
        tpots = sorted(t for _, t in self._window if t is not None)
        return {
            "limit": self.limit,
            "num_in_flight": self.num_admitted,
            "num_queued": len(self._queue),
            "num_shed": self.num_shed,
            "is_slow_start": self.is_slow_start,
            "num_samples": len(self._window),
            "ttft_p50_ms": _ms(percentile(ttfts, 0.5)),
            "ttft_p95_ms": _ms(percentile(ttfts, 0.95)),
            "tpot_p50_ms": _ms(percentile(tpots, 0.5)),
            "tpot_p95_ms": _ms(percentile(tpots, 0.95)),
            "max_admitted_wait_ms": round(self.max_admitted_wait_s * 1000, 3),
        }

    # -- the limit --------------------------------------------------------------------------------------------

    def _take(self) -> SloTicket:
        self.num_admitted += 1
        self._epoch.peak_admitted = max(self._epoch.peak_admitted, self.num_admitted)
        return SloTicket(self.generation)

    def _sample(self, ttft_s: float | None, tpot_s: float | None) -> None:
        epoch = self._epoch
        epoch.num_samples += 1
        if ttft_s is not None:
            epoch.ttfts.append(ttft_s)
        if tpot_s is not None:
            epoch.tpots.append(tpot_s)
        if epoch.num_samples >= self.epoch_size:
            self._adapt(epoch)

    def _adapt(self, epoch: _Epoch) -> None:
        load = self._load(epoch)  # the epoch's p95 over the SLO's, the worse of TTFT and TPOT
        if load > 1.0:
            self.limit = max(1, math.floor(self.limit * DECREASE_FACTOR))
            self.is_slow_start = False
            self.generation += 1
            self.num_decreases += 1
        elif epoch.peak_admitted >= self.limit and self.limit < self.config.max_limit:
            if self.is_slow_start and load > SLOW_START_EXIT:
                self.is_slow_start = False  # close to the SLO: from here one at a time
            grown = self.limit * 2 if self.is_slow_start else self.limit + 1
            self.limit = min(grown, self.config.max_limit)
            self.num_increases += 1
        self._epoch = _Epoch(peak_admitted=self.num_admitted)

    def _load(self, epoch: _Epoch) -> float:
        config, load = self.config, 0.0
        for target_ms, values in ((config.ttft_ms, epoch.ttfts), (config.tpot_ms, epoch.tpots)):
            p95 = percentile(sorted(values), 0.95)
            if target_ms is not None and p95 is not None:
                load = max(load, p95 * 1000 / target_ms)
        return load

    # -- the queue --------------------------------------------------------------------------------------------

    def _hand_off(self) -> None:
        """Freed places (a release, a raised limit) go to the next waiters; one past its deadline is shed instead
        (its timer may not have run yet), so no admitted request waited longer than `max_wait_s`."""
        while self.num_admitted < self.limit:
            waiter = self._queue.pop()
            if waiter is None:
                return
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.future.done():
                continue
            waited = self._clock() - waiter.enqueued_at
            if waited > self.config.max_wait_s:
                waiter.future.set_exception(self._shed("no place freed up within its deadline"))
                continue
            self.max_admitted_wait_s = max(self.max_admitted_wait_s, waited)
            waiter.future.set_result(self._take())

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.entry is not None and self._queue.remove(waiter.entry) and not waiter.future.done():
            waiter.future.set_exception(self._shed("no place freed up within its deadline"))

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter cancelled (its client left): out of the queue, or its place given back if it had one."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.entry is not None and self._queue.remove(waiter.entry):
            return
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result())

    def _shed(self, why: str) -> OverloadedError:
        self.num_shed += 1
        config = self.config
        retry_after = max(1, math.ceil(config.max_wait_s))
        return OverloadedError(
            f"The model's deployments are at the concurrency that meets its SLO and {why} "
            f"({len(self._queue)} waiting, at most {config.max_wait_s * 1000:.0f} ms each). Retry after "
            f"{retry_after} s, or send fewer requests at once.",
            headers={"retry-after": str(retry_after)},
        )


def slo_states(routes: Iterable[Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """`(model id, deployment, DeploymentSlo.state())` of every deployment of the routes' models with `slo` (the
    router's `ModelRoute`s): what the Prometheus gauges read at scrape time."""
    for route in routes:
        if route.has_slo:
            for deployment in route.deployments:
                if deployment.slo is not None:
                    yield route.id, deployment.name, deployment.slo.state()


def with_room(deployments: Sequence[Any]) -> list[Any]:
    """An SLO model's candidates: those with room under their limit; when none has, the one whose queue is
    shortest per unit of limit (its requests will wait least), so waiting requests spread over the deployments."""
    roomy = [d for d in deployments if d.slo is None or d.slo.has_room]
    if roomy:
        return roomy
    return [min(deployments, key=lambda d: ((d.slo.num_admitted + d.slo.num_queued) / d.slo.limit, d.name))]


class TimedStream:
    """A stream's chunks as they pass, timed for its TPOT: the last chunk's time and the tokens after the first
    (the usage chunk's `completion_tokens` when it comes, else one per content chunk)."""

    def __init__(self, chunks: AsyncIterator[Json], first_at: float) -> None:
        self.inner = chunks
        self.first_at = first_at
        self.last_at = first_at
        self.num_chunks = 1  # the first, already taken
        self.num_tokens: int | None = None

    def __aiter__(self) -> TimedStream:
        return self

    async def __anext__(self) -> Json:
        chunk = await anext(self.inner)
        usage = chunk.get("usage") if isinstance(chunk, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.num_tokens = usage["completion_tokens"]
        elif chunk.get("choices"):
            self.num_chunks += 1
            self.last_at = time.perf_counter()
        return chunk

    async def aclose(self) -> None:
        aclose = getattr(self.inner, "aclose", None)
        if aclose is not None:
            await aclose()

    def usage_so_far(self) -> Json | None:
        inner = self.inner
        return inner.usage_so_far() if isinstance(inner, ReportsStreamUsage) else None

    def engine_stages(self) -> object:
        """The local engine's stages of the request, where the stream reports them (else None)."""
        stages = getattr(self.inner, "engine_stages", None)
        return stages() if callable(stages) else None

    def tpot_s(self) -> float | None:
        num_tokens = self.num_tokens if self.num_tokens is not None else self.num_chunks
        if num_tokens < 2 or self.last_at <= self.first_at:
            return None
        return (self.last_at - self.first_at) / (num_tokens - 1)


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of sorted values (None for none)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
