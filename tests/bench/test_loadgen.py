"""Closed and open loops against a fake server: warm-up excluded, bounded, and open loop not waiting on the server."""

from __future__ import annotations

import time

import pytest
from bench_fakes import FakeConfig, FakeServer

from bench.client import BenchClient
from bench.loadgen import LevelSpec, run_level
from bench.workload import parse_length_dist, synthetic_workload


def _requests():  # type: ignore[no-untyped-def]
    return iter(synthetic_workload(parse_length_dist("8"), parse_length_dist("2")))


async def test_closed_loop_excludes_warmup_and_stops_at_the_request_count() -> None:
    spec = LevelSpec(concurrency=2, warmup_s=0.25, max_requests=6)
    with FakeServer(FakeConfig(ttft_s=0.05)) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            start = time.perf_counter()
            run = await run_level(client, _requests(), spec)
    assert len(run.results) == 6
    assert run.num_warmup >= 2  # two workers were busy through the warm-up
    assert all(r.started_at >= start + spec.warmup_s for r in run.results)
    assert run.wall_s > 0


async def test_closed_loop_with_a_duration_starts_nothing_after_it() -> None:
    spec = LevelSpec(concurrency=3, duration_s=0.3)
    with FakeServer(FakeConfig(ttft_s=0.05)) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            start = time.perf_counter()
            run = await run_level(client, _requests(), spec)
    assert run.results
    assert all(start <= r.started_at < start + spec.duration_s for r in run.results)


async def test_open_loop_keeps_sending_while_the_server_is_slow() -> None:
    spec = LevelSpec(rate=50.0, max_requests=12, seed=1)
    seen: list[float] = []
    with FakeServer(FakeConfig(ttft_s=0.3)) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            run = await run_level(client, _requests(), spec, on_result=lambda r: seen.append(r.started_at))
    assert len(run.results) == 12 == len(seen)
    first_end = min(r.started_at + r.e2e_s for r in run.results)
    assert sum(r.started_at < first_end for r in run.results) > 1  # a closed loop of one would give exactly 1


async def test_open_loop_drops_arrivals_beyond_max_in_flight() -> None:
    spec = LevelSpec(rate=200.0, max_requests=10, max_in_flight=1, seed=2)
    with FakeServer(FakeConfig(ttft_s=0.05)) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            run = await run_level(client, _requests(), spec)
    assert run.num_dropped > 0
    assert len(run.results) + run.num_dropped >= 10


def test_a_level_must_be_bounded_and_of_one_kind() -> None:
    with pytest.raises(ValueError, match="always ends"):
        LevelSpec(concurrency=1)
    with pytest.raises(ValueError, match="either"):
        LevelSpec(concurrency=1, rate=2.0, max_requests=1)
