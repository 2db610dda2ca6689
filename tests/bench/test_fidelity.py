"""Fidelity: the figures `unigate bench` reports match the timings a server delivered, at every concurrency.

The server (tests/bench/timed_sse_server.py) runs on its own event loop in a thread of this process, sends each
content chunk on a fixed schedule and records when it handed it to the socket; the bench's own closed loop
(`run_level` + `BenchClient`, on the event loop the CLI uses) measures the same requests. Both read CLOCK_MONOTONIC.

Tolerance, per level, on the p50 over the same measured requests on both sides (the median shrugs off the few
requests a scheduling stall on a busy machine delays; a client that delays its reads moves all of them):

- TTFT p50 within 10 ms + 5% of the delivered TTFT p50 (100 ms injected: 15 ms);
- TPOT p50 within 1 ms + 5% of the delivered TPOT p50 (20 ms injected: 2 ms).

Why that wide: on the loaded 2-core development VM this client lands 0.3-0.7 ms over the delivered TTFT at c = 1, 4
and 16 and 1.7-2.7 ms over at c = 64, and within 0.1 ms of the delivered TPOT, in this test, where the server shares
the process; CI runs beside other jobs, so the bounds leave 5-40x room. Why not wider: the httpx client this one
replaced was 67-70 ms over at c = 64 and 13-16 ms over at c = 16 in this same test, so it fails at c = 64 in every run
and at c = 16 in most. The precise figures, with the server in its own process, are benchmarks/bench_fidelity.py's.

The server thread and the client share the GIL: with Python's default 5 ms switch interval, a thread that wants it
can wait up to 5 ms behind the other one's burst of work, an artefact of running both in one process that a real
server never imposes on a client. The test shortens the interval to 0.5 ms while it runs.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator

import pytest
from timed_sse_server import Delivered, TimedSSEServer

from bench import loop
from bench.client import BenchClient
from bench.loadgen import LevelRun, LevelSpec, run_level
from bench.workload import parse_length_dist, synthetic_workload

TTFT_S = 0.100
ITL_S = 0.020
NUM_TOKENS = 6  # one request lasts 100 + 5 × 20 = 200 ms
MIN_REQUESTS = 6  # measured per level: at least 2 per worker, and enough for a median at c=1


def _num_requests(concurrency: int) -> int:
    return max(MIN_REQUESTS, 2 * concurrency)


async def _measure(server: TimedSSEServer, concurrency: int) -> tuple[LevelRun, list[Delivered]]:
    """One warm-up round (it opens the connections) that neither side keeps, then the measured requests."""
    workload = iter(synthetic_workload(parse_length_dist("16"), parse_length_dist(str(NUM_TOKENS))))
    async with BenchClient(server.base_url, "", "fake-model", max_connections=concurrency) as client:
        await run_level(client, workload, LevelSpec(concurrency=concurrency, max_requests=concurrency))
        server.take_delivered()
        spec = LevelSpec(concurrency=concurrency, max_requests=_num_requests(concurrency))
        return await run_level(client, workload, spec), server.take_delivered()


@pytest.fixture(autouse=True)
def short_gil_switch_interval() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(previous)


@pytest.mark.parametrize("concurrency", [1, 4, 16, 64])
def test_ttft_and_tpot_p50_match_the_delivered_timings(concurrency: int) -> None:
    with TimedSSEServer(TTFT_S, ITL_S) as server:
        run, delivered = loop.run(_measure(server, concurrency))
    assert len(run.results) == len(delivered) == _num_requests(concurrency)
    assert all(r.is_ok and r.num_output_tokens == NUM_TOKENS for r in run.results), {r.error_code for r in run.results}
    delivered_ttft_ms = statistics.median(d.ttft_s * 1000 for d in delivered if d.ttft_s is not None)
    delivered_tpot_ms = statistics.median(d.tpot_s * 1000 for d in delivered if d.tpot_s is not None)
    ttft_ms = statistics.median(r.ttft_s * 1000 for r in run.results if r.ttft_s is not None)
    tpot_ms = statistics.median(r.tpot_s * 1000 for r in run.results if r.tpot_s is not None)
    figures = (
        f"c={concurrency}: TTFT {ttft_ms:.2f} vs {delivered_ttft_ms:.2f}, TPOT {tpot_ms:.3f} vs {delivered_tpot_ms:.3f}"
    )
    assert abs(ttft_ms - delivered_ttft_ms) <= 10 + 0.05 * delivered_ttft_ms, figures
    assert abs(tpot_ms - delivered_tpot_ms) <= 1 + 0.05 * delivered_tpot_ms, figures
