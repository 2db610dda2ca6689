"""Teams end to end (issue 38): two real gateway instances on one Redis, fake upstreams, teams and keys made over
the admin API. A team's limits and budget hold across its keys and across the instances, a refusal names the team,
and the team's usage is what its keys spent while in it."""

from __future__ import annotations

import asyncio
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
DEAR = {"input_per_mtok": 0, "output_per_mtok": 200_000}  # 4 completion tokens cost $0.80


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


async def admin_post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url, json=body, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    created: dict[str, Any] = response.json()
    return created


async def team_with_keys(
    client: httpx.AsyncClient, base_url: str, num_keys: int, **limits: Any
) -> tuple[str, list[dict[str, str]]]:
    team = await admin_post(client, f"{base_url}/admin/teams", {"name": "research", **limits})
    keys = [await admin_post(client, f"{base_url}/admin/keys", {"team_id": team["id"]}) for _ in range(num_keys)]
    return team["id"], [{"authorization": f"Bearer {key['key']}"} for key in keys]


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[list[ThreadedServer]]:
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    models = [
        {"id": "dear", "deployments": [up], "pricing": DEAR},
        {"id": "gpt-test", "deployments": [{**up, "name": "cheap"}], "pricing": {"output_per_mtok": 0.6}},
    ]
    with gateway_instances(redis_url, tmp_path, models) as servers:
        yield servers


async def test_a_team_rpm_holds_across_its_keys_and_instances(gateways: list[ThreadedServer]) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        _, (one, two) = await team_with_keys(client, a.url, 2, rpm=3)
        statuses = []
        for i in range(4):
            response = await client.post(
                f"{(a, b)[i % 2].url}/v1/chat/completions", json=chat("gpt-test"), headers=(one, two)[i % 2]
            )
            statuses.append(response.status_code)
    assert statuses == [200, 200, 200, 429]
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "team 'research'" in error["message"]


async def test_twenty_concurrent_requests_never_overshoot_a_team_budget(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    """20 concurrent $0.80 requests over two keys of a $1 team, through two gateways: one is served."""
    fake_upstream.behave(ttft_s=0.3, usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11})
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        team_id, users = await team_with_keys(client, a.url, 2, budget_usd=1)
        jobs = [
            client.post(
                f"{(a, b)[i % 2].url}/v1/chat/completions", json=chat("dear", max_tokens=5), headers=users[i % 2]
            )
            for i in range(20)
        ]
        responses = await asyncio.gather(*jobs)
        await asyncio.sleep(0.3)  # a settle may land just after its response
        team = (await client.get(f"{a.url}/admin/teams/{team_id}", headers=ADMIN)).json()
        usage = (await client.get(f"{a.url}/admin/teams/{team_id}/usage", headers=ADMIN)).json()
    refused = [r.json()["error"] for r in responses if r.status_code != 200]
    assert {error["code"] for error in refused} <= {"budget_exceeded"} and len(refused) >= 18
    assert all("team 'research'" in error["message"] for error in refused)
    assert team["spend_usd"] <= 1.0 + 1e-9 and team["spend_usd"] == pytest.approx(0.8 * (20 - len(refused)))
    assert sum(row["requests"] for row in usage["data"]) == 20 - len(refused)
