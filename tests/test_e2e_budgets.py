"""Hard budgets end to end (issue 38): two real gateway instances on one Redis, fake upstreams. Every request holds
its worst case (a prompt bound that never undercounts + every output, at the dearest model that may serve it)
until it settles, so what is in flight can no longer overshoot a budget; a stream cut before its usage chunk is
charged that prompt bound and counted as estimated."""

from __future__ import annotations

import asyncio
import contextlib
import socket
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
# $0.20 per output token, prompts free: 4 completion tokens cost $0.80, a max_tokens of 5 holds $1.00.
DEAR = {"input_per_mtok": 0, "output_per_mtok": 200_000}


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


async def create_key(client: httpx.AsyncClient, base_url: str, **fields: Any) -> tuple[str, dict[str, str]]:
    response = await client.post(f"{base_url}/admin/keys", json=fields, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    return response.json()["id"], {"authorization": f"Bearer {response.json()['key']}"}


async def spent(client: httpx.AsyncClient, url: str, key_id: str) -> dict[str, Any]:
    await asyncio.sleep(0.3)  # a settle may land just after its response
    record: dict[str, Any] = (await client.get(f"{url}/admin/keys/{key_id}", headers=ADMIN)).json()
    return record


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[list[ThreadedServer]]:
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    models = [
        {"id": "dear", "deployments": [up], "pricing": DEAR},
        {"id": "gpt-test", "deployments": [{**up, "name": "cheap"}], "pricing": {"output_per_mtok": 0.6}},
    ]
    with gateway_instances(redis_url, tmp_path, models) as servers:
        yield servers


async def test_twenty_concurrent_requests_through_two_gateways_never_overshoot_the_budget(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    """Today's bug: 20 concurrent $0.80 requests on a $1 budget were all served ($16)."""
    fake_upstream.behave(ttft_s=0.3, usage={"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11})
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, budget_usd=1)
        jobs = [
            client.post(f"{(a, b)[i % 2].url}/v1/chat/completions", json=chat("dear", max_tokens=5), headers=user)
            for i in range(20)
        ]
        responses = await asyncio.gather(*jobs)
        record = await spent(client, a.url, key_id)
    codes = [r.json()["error"]["code"] for r in responses if r.status_code != 200]
    assert set(codes) <= {"budget_exceeded"} and len(codes) >= 18
    assert record["spend_usd"] <= 1.0 + 1e-9 and record["spend_usd"] == pytest.approx(0.8 * (20 - len(codes)))
    message = next(r.json()["error"]["message"] for r in responses if r.status_code == 429)
    assert "left" in message and "up to $1" in message


async def test_a_completions_prompt_list_that_cannot_fit_is_refused_and_costs_nothing(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    """Today's bug: 16 prompts × n 8 on a $0.001 budget was served ($1.03)."""
    a, _ = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, budget_usd=0.001)
        payload = {"model": "gpt-test", "prompt": ["Write a story."] * 16, "n": 8, "max_tokens": 100}
        response = await client.post(f"{a.url}/v1/completions", json=payload, headers=user)
        record = await spent(client, a.url, key_id)
    assert response.status_code == 429 and response.json()["error"]["code"] == "budget_exceeded"
    assert "$0.001 left" in response.json()["error"]["message"]
    assert record["spend_usd"] == 0 and record["num_requests"] == 0 and not fake_upstream.requests


async def test_a_fallback_to_a_dearer_model_is_reserved_at_its_price(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    """Today's bug: a fallback to a pricier model spent $8 on a $1 budget. A key that may use the dear fallback
    holds its price; a key restricted to the cheap model holds the cheap price only."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    down = {**up, "base_url": f"http://127.0.0.1:{closed_port}/v1", "name": "down"}
    models = [
        {"id": "cheap", "deployments": [down], "pricing": {"input_per_mtok": 0.1, "output_per_mtok": 0.1}},
        {"id": "dear", "deployments": [up], "pricing": DEAR},
    ]
    with gateway_instances(redis_url, tmp_path, models, fallbacks={"cheap": ["dear"]}) as (a, _):
        async with httpx.AsyncClient(timeout=30) as client:
            key_id, user = await create_key(client, a.url, budget_usd=1)
            refused = await client.post(f"{a.url}/v1/chat/completions", json=chat("cheap", max_tokens=8), headers=user)
            _, narrow = await create_key(client, a.url, models=["cheap"], budget_usd=1)
            admitted = await client.post(
                f"{a.url}/v1/chat/completions", json=chat("cheap", max_tokens=8), headers=narrow
            )
            record = await spent(client, a.url, key_id)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_exceeded"
    assert "up to $1.6" in refused.json()["error"]["message"]  # 8 output tokens at dear's $0.20
    assert admitted.json()["error"]["code"] != "budget_exceeded"  # cheap is down: 503, but never the budget
    assert record["spend_usd"] == 0 and not fake_upstream.requests


async def test_a_cut_cjk_stream_is_charged_at_least_its_real_prompt_and_marked_estimated(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    """Today's bug: 1,500 CJK characters (4,028 tokens by the bundled model's tokenizer) were charged 376. Under
    any byte-level BPE a prompt has at most as many tokens as UTF-8 bytes, so the charge must reach them."""
    fake_upstream.behave(mode="stream_cut", cut_after=2)
    a, _ = gateways
    text = "漢字かな交じり文の試験です。" * 107 + "終了"  # 1,500 characters, 4,500 UTF-8 bytes
    assert len(text) == 1500
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url)
        payload = {"model": "gpt-test", "messages": [{"role": "user", "content": text}], "stream": True}
        async with client.stream("POST", f"{a.url}/v1/chat/completions", json=payload, headers=user) as response:
            with contextlib.suppress(httpx.HTTPError):  # the gateway ends the cut stream with an error event
                async for _ in response.aiter_bytes():
                    pass
        record = await spent(client, a.url, key_id)
        usage = (await client.get(f"{a.url}/admin/keys/{key_id}/usage", headers=ADMIN)).json()
    assert record["prompt_tokens"] >= len(text.encode())
    assert usage["data"][0]["estimated_requests"] == 1
