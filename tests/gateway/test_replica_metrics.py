"""The replica metrics poller: what it reads from vLLM, SGLang and unigate pages, and whom it sends a key."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.replica_metrics import ReplicaMetricsPoller, parse_load
from gateway.router import Router
from gateway.routing_config import parse_routing

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="a b}c"} 0.25
vllm:num_requests_waiting_by_reason{reason="x"} 99
"""
SGLANG = 'sglang:num_running_reqs{model_name="m"} 7\nsglang:num_queue_reqs{model_name="m"} 1\nsglang:token_usage 0.5\n'
UNIGATE = (
    'unigate_engine_running_seqs{deployment="d"} 2\nunigate_engine_waiting_seqs{deployment="d"} 0\n'
    'unigate_engine_kv_blocks_used{deployment="d"} 30\nunigate_engine_kv_blocks_total{deployment="d"} 120\n'
)


def test_each_engines_names_are_read_and_series_summed() -> None:
    assert parse_load(VLLM) == (5.0, 4.0, 0.25)
    assert parse_load(SGLANG) == (7.0, 1.0, 0.5)
    assert parse_load(UNIGATE) == (2.0, 0.0, 0.25)


def test_a_page_without_a_running_count_is_a_missing_signal() -> None:
    assert parse_load("process_cpu_seconds_total 12.5\n") is None
    assert parse_load("") is None
    assert parse_load("vllm:num_requests_running NaN\n") is None
    assert parse_load("vllm:num_requests_running -3\nvllm:kv_cache_usage_perc 7\n") == (0.0, 0.0, 1.0)


@pytest.fixture
async def metrics_server() -> AsyncIterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []

    async def metrics(request: web.Request) -> web.Response:
        seen.append(request.headers.get("authorization"))
        return web.Response(text=VLLM)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_the_key_goes_only_to_the_upstreams_own_origin(metrics_server: tuple[str, list[str | None]]) -> None:
    url, seen = metrics_server
    same = {
        "type": "openai",
        "name": "same",
        "base_url": f"{url}/v1",
        "api_key": "sk-up",
        "metrics_url": f"{url}/metrics",
    }
    other = {**same, "name": "other", "base_url": "http://127.0.0.2:1/v1"}
    routing = parse_routing(
        {"models": [{"id": "m", "routing": "least_load", "deployments": [same, other]}]}, source="test.yaml"
    )
    router = Router(routing, {"same": None, "other": None})  # type: ignore[dict-item]
    poller = ReplicaMetricsPoller(clock=lambda: 50.0)
    poller.router = router  # one round, by hand (start() would run them every interval)
    try:
        await poller.poll_once()
    finally:
        await poller.stop()
    assert sorted(seen, key=str) == ["Bearer sk-up", None]
    for deployment in router.deployments:
        assert (deployment.replica.num_running, deployment.replica.num_waiting) == (5.0, 4.0)
        assert deployment.replica.read_at == 50.0


async def test_a_default_policy_model_is_never_polled() -> None:
    deployment = {"type": "openai", "name": "d", "base_url": "http://127.0.0.1:1/v1", "metrics_url": "http://x/m"}
    routing = parse_routing({"models": [{"id": "m", "deployments": [deployment]}]}, source="test.yaml")
    router = Router(routing, {"d": None})  # type: ignore[dict-item]
    poller = ReplicaMetricsPoller()
    poller.start(router)
    assert poller.deployments == [] and poller._task is None
    await poller.stop()
    assert router.deployments[0].replica.read_at == -math.inf
