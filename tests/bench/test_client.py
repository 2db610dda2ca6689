"""The measuring client against a fake server with injected latencies: figures must match what was injected."""

from __future__ import annotations

import statistics

from bench_fakes import FakeConfig, FakeServer

from bench.client import BenchClient, RequestResult, error_code_of, server_root
from bench.workload import BenchRequest

TTFT_S = 0.100
ITL_S = 0.020
# The fake server's sleeps run on an event loop whose timers fire by its cached loop clock at millisecond
# granularity (libuv under uvloop), so one can end up to a millisecond early by the client's clock (seen: a 100 ms
# sleep measured as 99.92 ms).
TIMER_MS = 2
NUM_TOKENS = 10
# Loopback HTTP plus asyncio timer slack on a busy 2-core box: generous above, tight below (sleep never
# returns early, so a value under the injected one is a measuring bug).
SLACK_MS = 25.0


def _request(max_tokens: int = NUM_TOKENS) -> BenchRequest:
    return BenchRequest([{"role": "user", "content": "hello there"}], max_tokens)


async def _send_many(server: FakeServer, num: int, **client_kwargs: object) -> list[RequestResult]:
    async with BenchClient(server.base_url, "", "fake-model", **client_kwargs) as client:  # type: ignore[arg-type]
        return [await client.send(_request()) for _ in range(num)]


async def test_measured_latencies_match_the_injected_ones() -> None:
    with FakeServer(FakeConfig(ttft_s=TTFT_S, itl_s=ITL_S)) as server:
        results = await _send_many(server, 5)
    for result in results:
        assert result.is_ok, result.error_code
        assert result.num_output_tokens == NUM_TOKENS and result.is_usage_reported
        assert len(result.itl_s) == NUM_TOKENS - 1
        assert result.ttft_s is not None and result.ttft_s * 1000 >= TTFT_S * 1000 - TIMER_MS
        assert result.tpot_s is not None and result.tpot_s * 1000 >= ITL_S * 1000 - TIMER_MS
    # Medians, so one scheduling stall on a busy box cannot fail the test; a measuring bug moves all of them.
    # The role-only chunk is sent at once: counting it as the first token would give a TTFT near zero.
    assert TTFT_S * 1000 - TIMER_MS <= statistics.median(r.ttft_s * 1000 for r in results) <= TTFT_S * 1000 + SLACK_MS
    assert ITL_S * 1000 - 1 <= statistics.median(r.tpot_s * 1000 for r in results) <= ITL_S * 1000 + 5
    gaps_ms = [gap * 1000 for r in results for gap in r.itl_s]
    assert ITL_S * 1000 - 1 <= statistics.median(gaps_ms) <= ITL_S * 1000 + 5
    expected_e2e_ms = (TTFT_S + ITL_S * (NUM_TOKENS - 1)) * 1000
    assert (
        expected_e2e_ms - TIMER_MS
        <= statistics.median(r.e2e_s * 1000 for r in results)
        <= expected_e2e_ms + 2 * SLACK_MS
    )


async def test_request_carries_max_tokens_ignore_eos_and_usage_option() -> None:
    with FakeServer() as server:
        await _send_many(server, 1)
    body = server.config.received[-1]
    assert body["max_tokens"] == NUM_TOKENS and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_without_usage_output_tokens_are_counted_from_chunks() -> None:
    with FakeServer(FakeConfig(is_usage_honoured=False)) as server:
        (result,) = await _send_many(server, 1)
    assert result.is_ok and not result.is_usage_reported
    assert result.num_output_tokens == NUM_TOKENS


async def test_probe_drops_ignore_eos_when_the_server_rejects_it() -> None:
    with FakeServer(FakeConfig(is_ignore_eos_rejected=True, eos_after=3)) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            probe = await client.probe()
            result = await client.send(_request())
    assert probe.is_ok and not probe.is_ignore_eos_sent and probe.is_usage_requested
    assert result.is_ok and result.num_output_tokens == 3  # the server stopped on its own


async def test_probe_reports_a_server_that_refuses_everything() -> None:
    with FakeServer(FakeConfig(models=["other"])) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            probe = await client.probe()
    assert not probe.is_ok and "model_not_found" in probe.message


async def test_failures_are_recorded_by_code_never_raised() -> None:
    cases = {
        "rate_limited": "rate_limit_exceeded",
        "broken_stream": "stream_broken",
        "no_done": "stream_incomplete",
        "stream_error": "upstream_error",
        "no_choices_stream": "no_content",
    }
    for failure, code in cases.items():
        with FakeServer(FakeConfig(failure=failure)) as server:
            (result,) = await _send_many(server, 1)
        assert result.error_code == code, failure
    (refused,) = await _send_many(FakeServer(), 1)  # never started: nothing listens on its port
    assert refused.error_code == "connection_error"


def test_error_codes_and_server_root() -> None:
    assert error_code_of(429, b'{"error": {"code": "tokens_limit_exceeded", "type": "x"}}') == "tokens_limit_exceeded"
    assert error_code_of(400, b'{"error": {"code": null, "type": "invalid_request_error"}}') == "invalid_request_error"
    assert error_code_of(502, b'{"type": "error", "error": {"type": "api_error"}}') == "api_error"
    assert error_code_of(503, b"<html>busy</html>") == "http_503"
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1/proxy/v1/v1") == "http://h:1/proxy"
