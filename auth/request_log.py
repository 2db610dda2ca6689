"""The request log: one record per finished request, kept in a Redis stream for a retention, read back by id or
by filter, newest first.

A record says who asked (key, team), what for (API family, route, model), who answered (deployment, each attempt
and its status and duration, a fallback), how it ended (status, error code, who ended it), what it used (tokens,
whether they were estimated, cost) and how long it took (time to first token, end to end). Never the prompt or the
answer text.

Writing is off the hot path: `RequestLog.add` puts a record in a bounded in-memory buffer, and a background task
appends each batch with one script call (`auth/lua/append_request_log.lua`: XADD per record, an id index entry,
and a trim to the retention and the length cap), sent on the gateway's command pipe (auth/resp_pipe.py): through
redis-py's client, a batch had cost the gateway ~26 k instructions a record, more than building and encoding it.
A Redis outage keeps the buffer (up to its bound, then the oldest records are dropped and counted) and retries on
the next flush.

    ug:{reqlog}:log          stream  entries: "r" record JSON
    ug:{reqlog}:ids:<day>    hash    request id -> entry id, for the requests logged that day (UTC, days since the
                                     epoch); expires a retention after the day ends

Both share the hash tag `{reqlog}`, so one script call touches one Redis Cluster slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import orjson

from auth import redis_names
from auth.redis_client import RedisClient
from auth.scripts import LuaScript, ScriptError, StorageError, Target, as_text, storage_errors

__all__ = [
    "AttemptRecord",
    "AttemptRow",
    "EndedBy",
    "RecordRow",
    "RequestFilter",
    "RequestLog",
    "RequestLogPage",
    "RequestRecord",
]

log = logging.getLogger("unigate.request_log")

EndedBy = Literal["finished", "client_left", "timeout", "error"]
_DAY_MS = 86_400_000
_SCAN_BATCH = 200  # entries read per XREVRANGE while filtering a page
# Records appended per script call. The call runs atomically (~5 us of Redis a record), so a batch holds every other
# client of that Redis for its length: 100 records, ~0.5 ms.
_WRITE_BATCH = 100
_MAX_SCANNED = 20_000  # a filtered page reads at most this many entries, then returns its cursor to go on from
_APPEND = LuaScript("append_request_log")

# A record as the gateway builds it on every request (gateway/request_trace.py): its values in `RequestRecord`'s
# field order, attempts as `AttemptRow`s. orjson writes the tuple as the JSON array a stored record is; building
# it costs a third of a `RequestRecord` and its encoding (the trace's `finish` and the JSON: 3.1 vs 1.1 us alone).
AttemptRow = tuple[str, int, float, str, float]  # deployment, status, duration_ms, code, start_ms
RecordRow = tuple[Any, ...]


# Records are not frozen: a frozen dataclass' __init__ sets each field through object.__setattr__, 2.6 vs 0.6 us
# for a RequestRecord, paid on every request. Nothing changes one after it is made.
@dataclass(slots=True)
class AttemptRecord:
    """One try at one deployment: its HTTP status (0: no answer), duration and error code ("" on success)."""

    deployment: str
    status: int
    duration_ms: float
    code: str = ""
    start_ms: float = 0.0  # when it started, after the request arrived


@dataclass(slots=True)
class RequestRecord:
    time_ms: int  # when the request arrived (ms since the epoch)
    request_id: str
    key_id: str | None  # None: the master key
    key_name: str
    team_id: str | None
    api: str  # "openai" | "anthropic" | "responses"
    route: str  # the path, e.g. /v1/chat/completions
    model: str  # as requested
    deployment: str | None  # the one that answered (None: none did)
    status: int  # the status the client got (499: the client left first)
    code: str = ""  # the error envelope's code, "" on success
    ended_by: EndedBy = "finished"
    is_stream: bool = False
    fallback: str | None = None  # the model that answered when a fallback did
    attempts: tuple[AttemptRecord, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    is_estimated: bool = False  # the token counts are the gateway's estimate (no usage from the backend)
    cost_micros: int = 0
    ttft_ms: float | None = None
    duration_ms: float = 0.0

    def row(self) -> RecordRow:
        """The values in field order, attempts as `AttemptRow`s: what is stored, as a JSON array (a third of the
        cost of an object with names)."""
        values = list(_FIELD_VALUES(self))
        values[_ATTEMPTS] = [(a.deployment, a.status, a.duration_ms, a.code, a.start_ms) for a in self.attempts]
        return tuple(values)

    @classmethod
    def from_json(cls, raw: bytes | str) -> RequestRecord:
        data = orjson.loads(raw)
        if isinstance(data, dict):  # written by name
            data["attempts"] = tuple(AttemptRecord(**a) for a in data.get("attempts", ()))
            return cls(**data)
        values = dict(zip(_FIELD_NAMES, data, strict=False))
        values["attempts"] = tuple(AttemptRecord(*a) for a in values.get("attempts", ()))
        return cls(**values)


_FIELD_NAMES = tuple(f.name for f in fields(RequestRecord))
_FIELD_VALUES = operator.attrgetter(*_FIELD_NAMES)
_ATTEMPTS = _FIELD_NAMES.index("attempts")


@dataclass(frozen=True, slots=True)
class RequestFilter:
    """What a listing keeps (every given field must match); times in ms since the epoch, `end_ms` exclusive."""

    key_id: str | None = None
    team_id: str | None = None
    model: str | None = None
    deployment: str | None = None
    status: int | None = None
    code: str | None = None
    start_ms: int | None = None
    end_ms: int | None = None

    def matches(self, record: RequestRecord) -> bool:
        return (
            (self.key_id is None or (record.key_id or "") == self.key_id)  # "": the master key
            and (self.team_id is None or (record.team_id or "") == self.team_id)
            and (self.model is None or record.model == self.model)
            and (self.deployment is None or record.deployment == self.deployment)
            and (self.status is None or record.status == self.status)
            and (self.code is None or record.code == self.code)
        )


@dataclass(frozen=True, slots=True)
class RequestLogPage:
    records: list[RequestRecord]
    next_cursor: str | None  # pass back to continue (older records); None: nothing older
    num_dropped: int = 0  # records this instance could not write (buffer full during an outage), since start


@dataclass
class RequestLog:
    """Writes records in batches off the hot path and reads them back; one per gateway instance. `writer`: what
    the batches are written on (the gateway's command pipe), `redis` when None."""

    redis: RedisClient
    writer: Target | None = None
    retention_days: float = 7.0
    max_len: int = 1_000_000
    max_buffered: int = 10_000
    flush_interval_s: float = 0.2
    clock: Callable[[], float] = time.time  # seconds since the epoch (tests move it)
    num_dropped: int = 0
    # Records wait encoded, as (request id + newline, JSON + newline): a record object kept until its batch is
    # written would survive the collector's young generation (and be traversed again and again); bytes are not.
    _buffer: deque[tuple[str, bytes]] = field(default_factory=deque)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    _is_down: bool = False
    _is_stopping: bool = False

    # -- writing ---------------------------------------------------------------------------------------------------

    def add(self, record: RequestRecord) -> None:
        """Queue a record (never waits, never raises); past the buffer's bound the oldest record is dropped."""
        self.add_row(record.row())

    def add_row(self, row: RecordRow) -> None:
        """`add` for a record's values in field order (`RecordRow`), as the gateway builds them."""
        if len(self._buffer) >= self.max_buffered:
            self._buffer.popleft()
            self.num_dropped += 1
        self._buffer.append((f"{row[1]}\n", orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)))
        if len(self._buffer) >= _WRITE_BATCH:
            self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="request-log")

    async def aclose(self) -> None:
        """Stop the background task and write what is buffered (best effort).

        The task is asked to stop, not cancelled: cancelled inside `asyncio.wait_for` (Python 3.11, uvloop) it was
        seen to stay "cancelling" forever, holding the server's shutdown until the server was abandoned."""
        if self._task is not None:
            self._is_stopping = True
            self._wake.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        with contextlib.suppress(StorageError):
            await self.flush()

    async def _run(self) -> None:
        while not self._is_stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.flush_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if self._is_stopping:
                return  # aclose() writes what is left
            try:
                await self.flush()
            except StorageError as exc:
                if not self._is_down:
                    log.warning(
                        "request log: cannot write to Redis (%s); keeping up to %d records", exc, self.max_buffered
                    )
                self._is_down = True
            else:
                self._is_down = False

    async def flush(self) -> int:
        """Write every buffered record now; returns how many were written (a batch its script refuses, a bug of
        ours, is dropped and counted in `num_dropped`)."""
        written = 0
        while self._buffer:
            batch = [self._buffer[i] for i in range(min(len(self._buffer), _WRITE_BATCH))]
            try:
                await self._append(batch)
            except ScriptError as exc:  # our bug, not an outage: retrying the same batch would fail forever
                log.error("request log: a batch of %d records was refused by its script: %s", len(batch), exc.detail)
                self.num_dropped += len(batch)
            else:
                written += len(batch)
            for _ in batch:
                self._buffer.popleft()
        return written

    async def _append(self, batch: list[tuple[str, bytes]]) -> None:
        # Two arguments a batch (ids, records; each ends in a newline), not two a record: see the script.
        retention_ms = int(self.retention_days * _DAY_MS)
        now_ms = int(self.clock() * 1000)
        day = now_ms // _DAY_MS
        args: list[str | int | bytes] = [
            now_ms - retention_ms,
            self.max_len,
            redis_names.request_log_index(day),
            (day + 1) * _DAY_MS + retention_ms,
        ]
        args.append("".join([request_id for request_id, _ in batch]))
        args.append(b"".join([record for _, record in batch]))
        await _APPEND(self.writer or self.redis, [redis_names.REQUEST_LOG], args)

    # -- reading ---------------------------------------------------------------------------------------------------

    async def get(self, request_id: str) -> RequestRecord | None:
        """The record of `request_id`, looked up in the day indexes a retention back (newest first)."""
        today = int(self.clock() * 1000) // _DAY_MS
        days = range(today + 1, today - int(self.retention_days) - 2, -1)  # +1: a writer whose clock runs ahead
        async with storage_errors():
            pipe = self.redis.pipeline(transaction=False)
            for day in days:
                pipe.hget(redis_names.request_log_index(day), request_id)
            found = [as_text(e) for e in await pipe.execute() if e is not None]
            if not found:
                return None
            entries = await self.redis.xrange(redis_names.REQUEST_LOG, found[0], found[0], count=1)
        return _record_of(entries[0]) if entries else None

    async def page(self, where: RequestFilter, *, limit: int = 50, cursor: str | None = None) -> RequestLogPage:
        """Newest first. A page holds up to `limit` matching records; `next_cursor` continues with older ones."""
        high = f"({cursor}" if cursor else (f"({where.end_ms}-0" if where.end_ms is not None else "+")
        low = f"{where.start_ms}-0" if where.start_ms is not None else "-"
        found: list[RequestRecord] = []
        num_scanned = 0
        async with storage_errors():
            while len(found) < limit and num_scanned < _MAX_SCANNED:
                entries = await self.redis.xrevrange(redis_names.REQUEST_LOG, high, low, count=_SCAN_BATCH)
                if not entries:
                    return RequestLogPage(found, None, self.num_dropped)
                for entry in entries:
                    num_scanned += 1
                    high = f"({as_text(entry[0])}"
                    if where.matches(record := _record_of(entry)):
                        found.append(record)
                        if len(found) == limit:
                            break
        return RequestLogPage(found, high[1:], self.num_dropped)

    async def after(self, entry_id: str | None, *, limit: int = 100) -> tuple[list[RequestRecord], str]:
        """Records newer than `entry_id` (oldest first) and the id to pass next time: the live tail. With no id,
        the position is "now" (nothing older is returned)."""
        async with storage_errors():
            if entry_id is None:
                newest = await self.redis.xrevrange(redis_names.REQUEST_LOG, "+", "-", count=1)
                return [], as_text(newest[0][0]) if newest else "0-0"
            entries = await self.redis.xrange(redis_names.REQUEST_LOG, f"({entry_id}", "+", count=limit)
        if not entries:
            return [], entry_id
        return [_record_of(e) for e in entries], as_text(entries[-1][0])


def _record_of(entry: Any) -> RequestRecord:
    fields = entry[1]
    return RequestRecord.from_json(fields.get("r", fields.get(b"r", b"{}")))
