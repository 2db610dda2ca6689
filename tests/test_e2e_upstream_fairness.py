"""Two real gateway instances on one Redis in front of a deployment with `max_in_flight: 1`: while one key's burst
waits for the slot, another key's requests (another tenant, on the other instance) are sent upstream within the
next hand-offs, not after the whole burst. The upstream's own log of what it received is the order of the slots."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.server import ThreadedServer
from fakes.upstream import Behavior, FakeUpstream

from auth import redis_names
from auth.redis_client import connect

ADMIN = {"authorization": f"Bearer {MASTER}"}
DEPLOYMENT = "capped"


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[list[ThreadedServer]]:
    deployment = {
        "type": "openai",
        "base_url": fake_upstream.base_url,
        "api_key": "sk-up",
        "name": DEPLOYMENT,
        "max_in_flight": 1,
        "pool_timeout": 60,
    }
    with gateway_instances(redis_url, tmp_path, [{"id": "gpt-test", "deployments": [deployment]}]) as servers:
        yield servers


def chat(label: str, *, stream: bool = False) -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": label}], "max_tokens": 8, "stream": stream}


async def create_key(client: httpx.AsyncClient, base_url: str, name: str) -> tuple[str, dict[str, str]]:
    response = await client.post(f"{base_url}/admin/keys", json={"name": name}, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    key = response.json()
    return key["id"], {"authorization": f"Bearer {key['key']}"}


async def until_waiting(redis_url: str, tenant: str, num_waiting: int) -> None:
    redis = connect(redis_url)
    try:
        for _ in range(2000):
            if await redis.llen(redis_names.upstream_line(DEPLOYMENT, "normal", tenant)) == num_waiting:
                return
            await asyncio.sleep(0.01)
    finally:
        await redis.aclose()
    raise AssertionError(f"{num_waiting} requests of {tenant} did not queue within 20 s")


async def test_a_burst_on_one_instance_does_not_hold_another_tenant_on_the_other(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream, redis_url: str
) -> None:
    one, two = gateways
    release_holder = threading.Event()
    # The first request upstream holds the slot (a stream that stops after one chunk) until the test lets it go.
    fake_upstream.queue(Behavior(mode="stream_cut", cut_after=1, cut_when=release_holder))
    async with httpx.AsyncClient(timeout=60) as client:
        _, holder = await create_key(client, one.url, "holder")
        tenant_a, key_a = await create_key(client, one.url, "burst")
        tenant_b, key_b = await create_key(client, two.url, "steady")

        holding = asyncio.create_task(
            client.post(f"{one.url}/v1/chat/completions", json=chat("holder", stream=True), headers=holder)
        )
        while not fake_upstream.requests:
            await asyncio.sleep(0.01)
        burst = [
            asyncio.create_task(client.post(f"{one.url}/v1/chat/completions", json=chat(f"A{i}"), headers=key_a))
            for i in range(12)
        ]
        await until_waiting(redis_url, tenant_a, 12)
        steady = [
            asyncio.create_task(client.post(f"{two.url}/v1/chat/completions", json=chat(f"B{i}"), headers=key_b))
            for i in range(2)
        ]
        await until_waiting(redis_url, tenant_b, 2)

        release_holder.set()
        responses = await asyncio.gather(*burst, *steady)
        await holding
    assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses]
    order = [request.body["messages"][0]["content"][0] for request in fake_upstream.requests[1:]]
    assert len(order) == 14
    assert "B" in order[:2], order  # the steady tenant's first request within the next two hand-offs
    assert order[:4].count("B") == 2, order  # and its second right after: turn about with the burst
