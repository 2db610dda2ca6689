"""The request log's store on a real Redis (every topology the session runs): records written in batches off the
hot path read back by id and by filter, newest first with a cursor, the live tail, and the retention and length
cap enforced as the clock moves."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes.redis_topologies import RedisProcess
from redis.asyncio import Redis

from auth import redis_names
from auth.cluster_pipe import make_pipe
from auth.request_log import AttemptRecord, RequestFilter, RequestLog, RequestRecord
from auth.scripts import Target

DAY_S = 86_400.0


def record(n: int, **fields: Any) -> RequestRecord:
    base: dict[str, Any] = {
        "time_ms": 1_700_000_000_000 + n,
        "request_id": f"req-{n}",
        "key_id": f"key_{n % 3:016x}",
        "key_name": f"k{n % 3}",
        "team_id": "team_a" if n % 2 else None,
        "api": "openai",
        "route": "/v1/chat/completions",
        "model": "m-even" if n % 2 == 0 else "m-odd",
        "deployment": "d1",
        "status": 200,
    }
    base.update(fields)
    return RequestRecord(**base)


class Clock:
    def __init__(self) -> None:
        import time

        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["client", "command pipe"])
async def writer(request: pytest.FixtureRequest, redis: Redis) -> AsyncIterator[Target | None]:
    """What the batches are written on: the Redis client, or the gateway's command pipe (as `build_app` does)."""
    if request.param == "client":
        yield None
        return
    pipe = make_pipe(redis)
    yield pipe
    await pipe.aclose()


async def test_a_record_reads_back_whole_by_its_request_id(redis: Redis, writer: Target | None) -> None:
    log = RequestLog(redis, writer=writer)
    rec = record(
        1,
        attempts=(AttemptRecord("d0", 503, 12.5, "upstream_unavailable"), AttemptRecord("d1", 200, 80.0)),
        fallback="m-backup",
        prompt_tokens=10,
        completion_tokens=20,
        cached_tokens=4,
        is_estimated=True,
        cost_micros=1234,
        ttft_ms=33.3,
        duration_ms=120.0,
        ended_by="client_left",
        is_stream=True,
        status=499,
        code="client_disconnected",
    )
    log.add(rec)
    assert await log.get("req-1") is None  # buffered: nothing written before the flush
    assert await log.flush() == 1
    assert await log.get("req-1") == rec
    assert await log.get("req-unknown") is None


async def test_listing_is_newest_first_filtered_and_paged_without_gaps(redis: Redis) -> None:
    log = RequestLog(redis)
    for n in range(60):
        log.add(record(n, status=200 if n % 5 else 429, code="" if n % 5 else "rate_limit_exceeded"))
    await log.flush()

    page = await log.page(RequestFilter(), limit=25)
    assert [r.request_id for r in page.records] == [f"req-{n}" for n in range(59, 34, -1)]
    seen: list[str] = []
    cursor = None
    while True:
        page = await log.page(RequestFilter(model="m-odd"), limit=7, cursor=cursor)
        seen += [r.request_id for r in page.records]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == [f"req-{n}" for n in range(59, -1, -1) if n % 2]

    limited = await log.page(RequestFilter(code="rate_limit_exceeded", key_id="key_0000000000000000"), limit=100)
    assert [r.request_id for r in limited.records] == [f"req-{n}" for n in range(59, -1, -1) if n % 15 == 0]
    assert all(r.status == 429 for r in limited.records)
    team = await log.page(RequestFilter(team_id="team_a", deployment="d1", status=200), limit=100)
    assert {r.request_id for r in team.records} == {f"req-{n}" for n in range(60) if n % 2 and n % 5}


async def test_time_range_uses_the_entries_own_times(redis: Redis) -> None:
    log = RequestLog(redis)
    log.add(record(1))
    await log.flush()
    raw = await redis.xrange(redis_names.REQUEST_LOG, "-", "+")
    entry_ms = int(raw[0][0].decode().split("-")[0])
    assert [r.request_id for r in (await log.page(RequestFilter(start_ms=entry_ms, end_ms=entry_ms + 1))).records] == [
        "req-1"
    ]
    assert (await log.page(RequestFilter(start_ms=entry_ms + 1))).records == []
    assert (await log.page(RequestFilter(end_ms=entry_ms))).records == []


async def test_the_tail_returns_only_what_came_after(redis: Redis) -> None:
    log = RequestLog(redis)
    log.add(record(1))
    await log.flush()
    records, position = await log.after(None)
    assert records == []
    log.add(record(2))
    log.add(record(3))
    await log.flush()
    records, position = await log.after(position)
    assert [r.request_id for r in records] == ["req-2", "req-3"]
    assert (await log.after(position))[0] == []


async def test_retention_and_length_cap_are_enforced(redis: Redis) -> None:
    clock = Clock()
    log = RequestLog(redis, retention_days=7, max_len=50, clock=clock)
    for n in range(80):
        log.add(record(n))
    await log.flush()
    assert await redis.xlen(redis_names.REQUEST_LOG) == 50  # the cap: the oldest 30 went
    assert await log.get("req-29") is None  # its index entry outlives it, but the entry itself is gone
    assert [r.request_id for r in (await log.page(RequestFilter(), limit=100)).records][-1] == "req-30"

    clock.now += 8 * DAY_S  # past the retention: everything written before is trimmed at the next write
    log.add(record(100))
    await log.flush()
    assert [r.request_id for r in (await log.page(RequestFilter(), limit=100)).records] == ["req-100"]
    # The index is one hash a day (by the writer's clock), expiring a retention after that day ends.
    day = int(clock.now // DAY_S)
    index = redis_names.request_log_index(day)
    assert await redis.hkeys(index) in ([b"req-100"], ["req-100"])
    expected_ttl_ms = (day + 1 + 7) * DAY_S * 1000 - (clock.now - 8 * DAY_S) * 1000  # Redis' clock is the real one
    assert abs(await redis.pttl(index) - expected_ttl_ms) < 60_000
    assert await log.get("req-100") is not None and await log.get("req-99") is None


async def test_a_record_is_found_by_id_from_any_day_of_the_retention(redis: Redis) -> None:
    clock = Clock()
    log = RequestLog(redis, retention_days=3, clock=clock)
    start = clock.now
    for n in range(4):  # one record a day (by the writers' clock), today and the three days after
        clock.now = start + n * DAY_S
        log.add(record(n))
        await log.flush()
    assert [(await log.get(f"req-{n}")) is not None for n in range(4)] == [True] * 4
    assert await log.get("req-9") is None
    clock.now = start + 6 * DAY_S  # three days and more after them, req-0's and req-1's days are not read
    assert [(await log.get(f"req-{n}")) is not None for n in range(4)] == [False, False, True, True]
    clock.now = start  # a reader whose clock is days behind the writer's looks one day ahead, not three
    assert [(await log.get(f"req-{n}")) is not None for n in range(4)] == [True, True, False, False]


async def test_a_full_buffer_drops_the_oldest_and_counts_them(redis: Redis) -> None:
    log = RequestLog(redis, max_buffered=5)
    for n in range(8):
        log.add(record(n))
    assert log.num_dropped == 3
    await log.flush()
    page = await log.page(RequestFilter(), limit=100)
    assert [r.request_id for r in page.records] == [f"req-{n}" for n in range(7, 2, -1)]
    assert page.num_dropped == 3


async def test_the_background_task_writes_without_an_explicit_flush(redis: Redis) -> None:
    import asyncio

    log = RequestLog(redis, flush_interval_s=0.01)
    log.start()
    try:
        log.add(record(1))
        for _ in range(500):
            if await log.get("req-1") is not None:
                break
            await asyncio.sleep(0.01)
        assert await log.get("req-1") == record(1)
    finally:
        await log.aclose()


async def test_stopping_the_writer_never_hangs_and_writes_what_was_buffered(redis: Redis) -> None:
    """Every stop returns, at any point of the writer's cycle, and writes what was buffered (a cancelled writer was
    seen to hang a gateway's shutdown: tests/gateway/test_client_disconnect.py's servers took 10 s to stop)."""
    import asyncio

    for n in range(40):
        log = RequestLog(redis, flush_interval_s=0.001 * (n % 4))
        log.start()
        for m in range(n % 3 + 1):
            log.add(record(1000 * n + m))
        await asyncio.sleep(0.0005 * (n % 5))
        await asyncio.wait_for(log.aclose(), 30)  # a hang fails here instead of holding the suite
        assert await log.get(f"req-{1000 * n}") is not None


async def test_a_batch_whose_ids_and_records_differ_is_our_error_not_an_outage(
    redis: Redis, writer: Target | None
) -> None:
    """The script takes a batch as two newline-ended strings; a mismatch (a bug of ours) is a script error, never
    "Redis is down", and adds nothing. The writer drops such a batch (counted) and goes on with the next."""
    from auth.request_log import _APPEND
    from auth.scripts import ScriptError

    args: list[str | int | bytes] = [0, 100, redis_names.request_log_index(1), 10**13, "a\nb\n", b"[1]\n"]
    try:
        await _APPEND(writer or redis, [redis_names.REQUEST_LOG], args)
    except ScriptError as exc:
        assert "differ in number" in exc.detail
    else:
        raise AssertionError("a mismatched batch was accepted")
    assert await redis.xlen(redis_names.REQUEST_LOG) == 0
    log = RequestLog(redis, writer=writer)
    log.add(record(0, request_id="bad\nid"))  # never from the gateway (ids are checked), so a bug's stand-in
    assert await log.flush() == 0 and log.num_dropped == 1 and await redis.xlen(redis_names.REQUEST_LOG) == 0
    ids = [f"id-{n}.A:z_{n}" for n in range(250)]  # every allowed kind of character, over two batches of 100
    for n, request_id in enumerate(ids):
        log.add(record(n, request_id=request_id))
    assert await log.flush() == 250 and log.num_dropped == 1
    for request_id in (ids[0], ids[199], ids[200], ids[-1]):
        found = await log.get(request_id)
        assert found is not None and found.request_id == request_id


async def test_records_wait_out_a_redis_outage_and_are_written_once_it_is_back(tmp_path: Path) -> None:
    """Written on the command pipe (as the gateway does), a batch Redis cannot take is kept, not lost: the flush
    fails as an outage (`StorageError`, not a script error), the buffer stays whole, and the next flush after the
    restart writes every record once."""
    from redis.asyncio import Redis as AsyncRedis

    from auth.scripts import StorageError

    server = RedisProcess(tmp_path / "redis").start()
    redis = AsyncRedis(host="127.0.0.1", port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5)
    pipe = make_pipe(redis)
    try:
        log = RequestLog(redis, writer=pipe)
        log.add(record(0))
        assert await log.flush() == 1
        server.stop(kill=True)
        for n in range(1, 151):  # more than one batch
            log.add(record(n))
        with pytest.raises(StorageError):
            await log.flush()
        assert len(log._buffer) == 150 and log.num_dropped == 0
        server.start()  # same port, empty (no persistence): what was written before is gone with it
        assert await log.flush() == 150
        assert await log.flush() == 0 and log.num_dropped == 0
        assert await redis.xlen(redis_names.REQUEST_LOG) == 150
        for n in (1, 100, 150):
            found = await log.get(f"req-{n}")
            assert found is not None and found == record(n)
    finally:
        await pipe.aclose()
        await redis.aclose()
        server.stop()
