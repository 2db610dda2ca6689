"""SLO-aware admission through a real gateway (uvicorn, Redis, keys) in front of a simulated replica
(tests/fakes/replica_sim.py): a request that cannot start by its deadline is shed with 503 `overloaded` and
`Retry-After`; waiting requests start in the tenants' fair order; the live limit goes down when the SLO breaks and
up while it holds; a model without `slo` shows no admission state."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.replica_sim import ReplicaFleet, SimParams
from fakes.server import ThreadedServer

ADMIN = {"authorization": f"Bearer {MASTER}"}
HOLD_TOKENS = 1_000_000  # a stream that outlives the test: it holds its place until the client closes it


@pytest.fixture
def fleet() -> Iterator[ReplicaFleet]:
    with ReplicaFleet(1, SimParams()) as fleet:  # real time: a decode step is ~12 ms
        yield fleet


def deployment(fleet: ReplicaFleet, name: str, **extra: Any) -> dict[str, Any]:
    return {"type": "openai", "name": name, "base_url": fleet.replicas[0].base_url, "api_key": "sk-sim", **extra}


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path, fleet: ReplicaFleet, request: pytest.FixtureRequest) -> Iterator[str]:
    slo, max_concurrency = request.param
    models = [
        {"id": "sim", "slo": slo, "deployments": [deployment(fleet, "r0", max_concurrency=max_concurrency)]},
        {"id": "plain", "deployments": [deployment(fleet, "plain0")]},
    ]
    with gateway_instances(redis_url, tmp_path, models, names=("a",)) as servers:
        server: ThreadedServer = servers[0]
        yield server.url


def chat(label: str, max_tokens: int = 2, *, stream: bool = True, model: str = "sim") -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": label}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def admission(client: httpx.AsyncClient, model: str = "sim") -> dict[str, Any]:
    response = await client.get("/admin/models", headers=ADMIN)
    assert response.status_code == 200, response.text
    route = next(m for m in response.json()["data"] if m["id"] == model)
    return {"model": route["slo"], "deployment": route["deployments"][0]["slo"]}


async def until(client: httpx.AsyncClient, what: str, value: int) -> None:
    for _ in range(3000):
        if (await admission(client))["deployment"][what] == value:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never reached {value}")


@asynccontextmanager
async def holding(client: httpx.AsyncClient, headers: dict[str, str]) -> AsyncIterator[httpx.Response]:
    """A stream admitted and running: its first chunk has arrived."""
    request = client.build_request("POST", "/v1/chat/completions", json=chat("hold", HOLD_TOKENS), headers=headers)
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: {"):
            break
    try:
        yield response
    finally:
        await response.aclose()


async def create_key(client: httpx.AsyncClient, name: str) -> dict[str, str]:
    response = await client.post("/admin/keys", json={"name": name}, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    return {"authorization": f"Bearer {response.json()['key']}"}


@pytest.mark.parametrize("gateway", [({"ttft_ms": 60_000, "max_wait_ms": 100}, 1)], indirect=True)
async def test_a_request_that_cannot_start_in_time_is_shed_with_retry_after(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        async with holding(client, ADMIN):
            await until(client, "num_in_flight", 1)
            shed = await client.post("/v1/chat/completions", json=chat("late", stream=False), headers=ADMIN)
            assert shed.status_code == 503, shed.text
            assert shed.json()["error"]["code"] == "overloaded"
            assert shed.json()["error"]["type"] == "service_unavailable"
            assert shed.headers["retry-after"] == "1"
            streamed = await client.post("/v1/chat/completions", json=chat("late too"), headers=ADMIN)
            assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "overloaded"
            state = await admission(client)
            assert state["model"]["ttft_ms"] == 60_000
            assert state["deployment"]["limit"] == 1 and state["deployment"]["num_shed"] == 2
            plain = await client.post("/v1/chat/completions", json=chat("plain", model="plain"), headers=ADMIN)
            assert plain.status_code == 200  # the same replica, a model without slo: admitted as ever
            metrics = (await client.get("/metrics")).text
    assert 'unigate_slo_limit{deployment="r0",model="sim"} 1.0' in metrics
    assert 'unigate_slo_in_flight{deployment="r0",model="sim"} 1.0' in metrics
    assert 'unigate_errors_total{code="overloaded"} 2.0' in metrics
    assert "plain0" not in "".join(line for line in metrics.splitlines() if line.startswith("unigate_slo_"))


@pytest.mark.parametrize("gateway", [({"ttft_ms": 60_000, "max_wait_ms": 60_000, "max_limit": 1}, 1)], indirect=True)
async def test_waiting_requests_start_in_the_tenants_fair_order(gateway: str, fleet: ReplicaFleet) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        key_a, key_b = await create_key(client, "a"), await create_key(client, "b")
        async with holding(client, ADMIN):
            await until(client, "num_in_flight", 1)
            waiting = []
            for i in range(3):
                body = chat(f"a{i}")
                waiting.append(asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=key_a)))
                await until(client, "num_queued", i + 1)
            waiting.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat("b0"), headers=key_b)))
            await until(client, "num_queued", 4)
        # The holder closed: its place goes to the first waiter in fair order, and so on.
        responses = await asyncio.gather(*waiting)
    assert [r.status_code for r in responses] == [200] * 4
    served = [m for m in fleet.replicas[0].stats.first_messages if m != "hold"]
    assert served == ["a0", "b0", "a1", "a2"]


@pytest.mark.parametrize("gateway", [({"tpot_ms": 1}, 2)], indirect=True)
async def test_the_limit_goes_down_when_the_slo_breaks(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        for i in range(8):  # one at a time: ~12 ms per token against a 1 ms TPOT
            response = await client.post("/v1/chat/completions", json=chat(f"r{i}", 4), headers=ADMIN)
            assert response.status_code == 200
        state = (await admission(client))["deployment"]
    assert state["limit"] == 1 and state["tpot_p50_ms"] > 1


@pytest.mark.parametrize("gateway", [({"tpot_ms": 60_000, "ttft_ms": 60_000}, 1)], indirect=True)
async def test_the_limit_goes_up_while_the_slo_holds_at_full_use(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        for i in range(8):  # one at a time, each using the whole limit of 1
            response = await client.post("/v1/chat/completions", json=chat(f"r{i}", 3), headers=ADMIN)
            assert response.status_code == 200
        state = (await admission(client))["deployment"]
    assert state["limit"] == 2 and state["num_samples"] == 8 and state["ttft_p95_ms"] is not None
