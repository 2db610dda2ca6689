"""Two real gateway instances (production wiring: `gateway.server.build_app`) sharing one real Redis.

They must act as one: a key created on one works on the other, a revocation on one is seen by the other within a
second, one RPM limit and one upstream `max_in_flight` cap hold across both.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

ADMIN = {"authorization": f"Bearer {MASTER}"}


def chat(model: str = "gpt-test") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
def gateways(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> Iterator[tuple[ThreadedServer, ThreadedServer]]:
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up", "max_in_flight": 2}
    models = [
        {"id": "gpt-test", "deployments": [{**deployment, "pool_timeout": 0.3}]},
        {"id": "other-model", "deployments": [{**deployment, "name": "other"}]},
    ]
    with gateway_instances(redis_url, tmp_path, models) as (a, b):
        yield a, b


async def create_key(base_url: str, **fields: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url) as client:
        response = await client.post("/admin/keys", json=fields, headers=ADMIN)
        assert response.status_code in (200, 201), response.text
        return dict(response.json())


async def test_key_made_on_one_instance_works_on_the_other_and_revocation_spreads(
    gateways: tuple[ThreadedServer, ThreadedServer],
) -> None:
    a, b = gateways
    key = await create_key(a.url, name="team", models=["gpt-test"])
    user = {"x-api-key": key["key"]}  # Anthropic-style header works on OpenAI routes too
    async with httpx.AsyncClient() as client:
        assert (await client.post(f"{b.url}/v1/chat/completions", json=chat(), headers=user)).status_code == 200
        models = (await client.get(f"{b.url}/v1/models", headers=user)).json()
        assert [m["id"] for m in models["data"]] == ["gpt-test"]  # the allowlist hides other-model
        denied = await client.post(f"{b.url}/v1/chat/completions", json=chat("other-model"), headers=user)
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"

        revoked = await client.delete(f"{a.url}/admin/keys/{key['id']}", headers=ADMIN)
        assert revoked.status_code == 200
        started = time.monotonic()
        while True:
            response = await client.post(f"{b.url}/v1/chat/completions", json=chat(), headers=user)
            if response.status_code == 401:
                break
            assert time.monotonic() - started < 1.0, "revocation did not reach the other instance within 1 s"
            await asyncio.sleep(0.05)
        assert response.json()["error"]["code"] == "key_revoked"


async def test_one_rpm_limit_across_both_instances(gateways: tuple[ThreadedServer, ThreadedServer]) -> None:
    a, b = gateways
    key = await create_key(a.url, rpm=6)
    user = {"authorization": f"Bearer {key['key']}"}
    async with httpx.AsyncClient() as client:
        responses = await asyncio.gather(
            *(
                client.post(f"{(a if i % 2 else b).url}/v1/chat/completions", json=chat(), headers=user)
                for i in range(16)
            )
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 6 + [429] * 10, [r.text[:300] for r in responses]
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    ok = next(r for r in responses if r.status_code == 200)
    assert ok.headers["x-ratelimit-limit-requests"] == "6"


async def test_one_upstream_cap_across_both_instances(
    gateways: tuple[ThreadedServer, ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    a, b = gateways
    fake_upstream.behave(mode="slow", ttft_s=1.5)
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(
            *(
                client.post(f"{(a if i % 2 else b).url}/v1/chat/completions", json=chat(), headers=ADMIN)
                for i in range(5)
            )
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 503, 503, 503]  # max_in_flight=2 for both instances together
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.json()["error"]["code"] == "upstream_at_capacity"
    assert "retry-after" in busy.headers
    assert len(fake_upstream.requests) == 2


@pytest.mark.parametrize("max_concurrent", [1, 2])
async def test_a_sequential_client_across_both_instances_never_trips_its_concurrency_limit(
    gateways: tuple[ThreadedServer, ThreadedServer], max_concurrent: int
) -> None:
    """Settles may finish after the response (only while a concurrency slot is to spare): a client that waits
    for each response before the next request, alternating instances, must never see its own lease in the way."""
    a, b = gateways
    key = await create_key(a.url, max_concurrent=max_concurrent, tpm=100_000)
    user = {"authorization": f"Bearer {key['key']}"}
    async with httpx.AsyncClient() as client:
        for i in range(12):
            body = {**chat(), "stream": i % 3 == 0}
            response = await client.post(f"{(a if i % 2 else b).url}/v1/chat/completions", json=body, headers=user)
            assert response.status_code == 200, response.text[:300]
        deadline = time.monotonic() + 2.0  # the last settle may land just after its response
        while True:
            usage = (await client.get(f"{a.url}/admin/keys/{key['id']}/usage", headers=ADMIN)).json()
            num_requests = sum(row["requests"] for row in usage["data"])
            if num_requests == 12 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert num_requests == 12, usage
