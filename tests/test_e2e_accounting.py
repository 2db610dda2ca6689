"""Accounting end to end: two real gateway instances (production wiring) sharing one real Redis, a fake upstream
that reports more usage than the gateway reserves (prompt 7 + completion 3 = 10 tokens for a request whose
reservation is 1 + max_tokens 8 = 9), every API family, streaming and not, sequential and concurrent clients.

RPM is exact, token and spend budgets are charged exactly with the upstream's reported usage, and the usage per
key, model and day is exact. These are the flows of issue 18, which a settle-script bug used to turn off.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.anthropic_upstream import UPSTREAM_KEY, FakeAnthropic
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.net import DelayingProxy
from fakes.server import ThreadedServer
from fakes.upstream import PROMPT_TOKENS, FakeUpstream

from auth.redis_client import connect, parse_redis_url

ADMIN = {"authorization": f"Bearer {MASTER}"}
COMPLETION_TOKENS = 3  # the fake's default num_chunks
USED = PROMPT_TOKENS + COMPLETION_TOKENS  # per request: above the 9-token reservation of every body below
COST_MICROS = 3  # 7 × 0.15 + 3 × 0.60 = 2.85 micro-dollars, rounded to 3 per request


def body(family: str, *, stream: bool, model: str = "gpt-test") -> tuple[str, dict[str, Any]]:
    if family == "chat":
        return "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": stream,
        }
    if family == "messages":
        return "/v1/messages", {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stream": stream,
        }
    return "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 8, "stream": stream}


@pytest.fixture
def gateways(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> Iterator[tuple[ThreadedServer, ThreadedServer]]:
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    pricing = {"input_per_mtok": 0.15, "output_per_mtok": 0.60, "currency": "USD"}
    models = [
        {"id": "gpt-test", "deployments": [deployment], "pricing": pricing},
        {"id": "unpriced", "deployments": [{**deployment, "name": "unpriced"}]},
    ]
    with gateway_instances(redis_url, tmp_path, models) as (a, b):
        yield a, b


async def create_key(client: httpx.AsyncClient, base_url: str, **fields: Any) -> tuple[str, dict[str, str]]:
    response = await client.post(f"{base_url}/admin/keys", json=fields, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    return response.json()["id"], {"authorization": f"Bearer {response.json()['key']}"}


async def send(client: httpx.AsyncClient, url: str, family: str, headers: dict[str, str], **kwargs: Any) -> int:
    path, payload = body(family, **kwargs)
    response = await client.post(url + path, json=payload, headers=headers)
    if response.status_code == 200 and kwargs.get("stream"):
        assert "[DONE]" in response.text or "message_stop" in response.text or "response.completed" in response.text
    return response.status_code


async def settled_record(client: httpx.AsyncClient, url: str, key_id: str, num_requests: int) -> dict[str, Any]:
    """The key's record once `num_requests` settles landed (the last may land just after its response)."""
    deadline = time.monotonic() + 5.0
    while True:
        record: dict[str, Any] = (await client.get(f"{url}/admin/keys/{key_id}", headers=ADMIN)).json()
        if record["num_requests"] >= num_requests or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.05)


FAMILIES = ("chat", "messages", "responses")


async def test_rpm_is_exact_when_usage_exceeds_the_reservation(
    gateways: tuple[ThreadedServer, ThreadedServer],
) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, rpm=5)
        statuses = [await send(client, (a, b)[i % 2].url, FAMILIES[i % 3], user, stream=i % 4 == 0) for i in range(40)]
        assert statuses == [200] * 5 + [429] * 35
        record = await settled_record(client, a.url, key_id, 5)
    assert record["num_requests"] == 5 and record["tokens_spent"] == 5 * USED


async def test_token_budget_is_charged_with_the_reported_usage(
    gateways: tuple[ThreadedServer, ThreadedServer],
) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        # Hard budgets reserve each request's worst case: 22 prompt tokens at most ("hi": 2 bytes, role "user": 4,
        # 2 × 8 template tokens) + max_tokens 8 = 30 for chat and messages.
        key_id, user = await create_key(client, b.url, token_budget=40)
        statuses = [await send(client, (a, b)[i % 2].url, FAMILIES[i % 2], user, stream=i == 1) for i in range(6)]
        # 0 → 10 → 20 tokens spent: the third request's worst case (20 + 30) no longer fits.
        assert statuses == [200, 200, 429, 429, 429, 429]
        record = await settled_record(client, a.url, key_id, 2)
        assert (record["budget_spent"], record["num_requests"], record["budget_remaining"]) == (20, 2, 20)
        path, payload = body("chat", stream=False)
        refused = await client.post(a.url + path, json=payload, headers=user)
        assert refused.json()["error"]["code"] == "budget_exceeded"
        assert "20 tokens left (20 spent of 40" in refused.json()["error"]["message"]
        usage = (await client.get(f"{a.url}/admin/usage", headers=ADMIN)).json()
    assert (usage["requests"], usage["total_tokens"]) == (2, 20)


async def test_the_next_request_on_another_instance_sees_the_charge_however_slow_the_first_instances_link(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    """Instance a reaches Redis through a link that holds everything it writes for 50 ms; b directly. A client
    sends one request to a, then one to b as soon as it has the answer: b's admission must count a's charge (a
    budget of one request's usage is then spent; a TPM of two reservations, 9 each, no longer fits after the
    first request's real 10). A key without such limits need not wait for its charge, and is served again."""
    if parse_redis_url(redis_url).kind != "standalone":
        pytest.skip("the delaying link stands in front of one Redis server")
    host, port = redis_url.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    models = [{"id": "gpt-test", "deployments": [deployment]}]
    with DelayingProxy(host, int(port), delay_s=0.05) as proxy:
        slow_url = redis_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}")
        with gateway_instances([slow_url, redis_url], tmp_path, models) as (a, b):
            async with httpx.AsyncClient(timeout=30) as client:
                # A budget of one request's worst case (30 tokens: see the budget test) and its usage, less one.
                budget = {"token_budget": 30 + USED - 1}
                for limits, expected in ((budget, 429), ({"tpm": 2 * 9}, 429), ({}, 200)):
                    _, user = await create_key(client, b.url, **limits)
                    assert await send(client, a.url, "chat", user, stream=False) == 200, limits
                    assert await send(client, b.url, "chat", user, stream=False) == expected, limits


async def test_usage_is_exact_for_concurrent_clients_of_every_family(
    gateways: tuple[ThreadedServer, ThreadedServer],
) -> None:
    """A key with no limits at all: every request is recorded, per model and day, on both instances."""
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url)
        jobs = [
            send(
                client,
                (a, b)[i % 2].url,
                FAMILIES[i % 3],
                user,
                stream=i % 2 == 0,
                model=("gpt-test", "unpriced")[i % 5 == 0],
            )
            for i in range(30)
        ]
        assert await asyncio.gather(*jobs) == [200] * 30
        record = await settled_record(client, b.url, key_id, 30)
        usage = (await client.get(f"{b.url}/admin/keys/{key_id}/usage", headers=ADMIN)).json()
        totals = (await client.get(f"{b.url}/admin/usage", headers=ADMIN)).json()
    num_unpriced = sum(1 for i in range(30) if i % 5 == 0)
    num_priced = 30 - num_unpriced
    assert (record["num_requests"], record["prompt_tokens"], record["completion_tokens"]) == (
        30,
        30 * PROMPT_TOKENS,
        30 * COMPLETION_TOKENS,
    )
    assert record["spend_usd"] == pytest.approx(num_priced * COST_MICROS / 1e6, abs=1e-12)
    rows = {row["model"]: row for row in usage["data"]}
    assert set(rows) == {"gpt-test", "unpriced"} and len({row["date"] for row in usage["data"]}) == 1
    assert rows["gpt-test"]["requests"] == num_priced and rows["unpriced"]["requests"] == num_unpriced
    assert rows["gpt-test"]["total_tokens"] == num_priced * USED
    assert rows["unpriced"]["spend_usd"] == 0 and rows["unpriced"]["unpriced_requests"] == num_unpriced
    assert rows["gpt-test"]["unpriced_requests"] == 0
    assert totals["by_day"][0]["requests"] == 30 and totals["by_day"][0]["total_tokens"] == 30 * USED
    assert totals["unpriced_requests"] == num_unpriced


async def test_spend_budget_in_usd(gateways: tuple[ThreadedServer, ThreadedServer]) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, budget_usd=0.00002, budget_period="day")  # 20 micro-dollars
        statuses = [await send(client, (a, b)[i % 2].url, FAMILIES[i % 3], user, stream=i % 2 == 1) for i in range(6)]
        # Each request costs 3 and holds its worst case while in flight: 8 micro-dollars for chat and messages
        # (30 tokens: see the token budget test), 6 for responses (18): 0 → 3 → 6 → 9 → 12 → 15, then 15 + 6 > 20.
        assert statuses == [200, 200, 200, 200, 200, 429]
        path, payload = body("chat", stream=False)
        refused = (await client.post(b.url + path, json=payload, headers=user)).json()["error"]
        record = await settled_record(client, a.url, key_id, 5)
    assert refused["code"] == "budget_exceeded"
    assert "$0.000005 left ($0.000015 spent of $0.00002, $0 reserved" in refused["message"]
    assert "up to $0.000008" in refused["message"] and "budget_usd" in refused["message"]
    assert record["budget_usd"] == pytest.approx(2e-5) and record["spend_usd"] == pytest.approx(15e-6)
    assert record["budget_usd_spent"] == pytest.approx(15e-6) and record["budget_usd_remaining"] == pytest.approx(5e-6)


@pytest.mark.parametrize("figure", [1e15, 10**15, -5, "12", 3.7, None])
async def test_absurd_usage_from_an_upstream_cannot_poison_a_key(
    gateways: tuple[ThreadedServer, ThreadedServer], fake_upstream: FakeUpstream, redis_url: str, figure: Any
) -> None:
    """An upstream reporting `prompt_tokens: 1e15` (or garbage) is charged a clamped integer; the key's token log
    keeps integer members and a TTL, and the key keeps answering (429 while the excess is in the window, never 503)."""
    a, b = gateways
    fake_upstream.behave(usage={"prompt_tokens": figure, "completion_tokens": 1, "total_tokens": 1})
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, tpm=1000)
        assert await send(client, a.url, "chat", user, stream=False) == 200
        record = await settled_record(client, a.url, key_id, 1)
        statuses = {await send(client, (a, b)[i % 2].url, "chat", user, stream=False) for i in range(4)}
    is_huge = isinstance(figure, int | float) and figure > 1000
    assert statuses == ({429} if is_huge else {200})
    expected = 2**40 if is_huge else (int(figure) if isinstance(figure, int | float) and figure > 0 else 0)
    assert record["prompt_tokens"] == expected
    redis = connect(redis_url)  # any topology the suite runs on
    try:
        log = f"ug:{{{key_id}}}:tpm"
        members = [member.decode() for member in await redis.zrange(log, 0, -1)]
        assert all(member.rpartition("|")[2].isdigit() for member in members), members
        assert await redis.pttl(log) > 0 and await redis.pttl(f"ug:{{{key_id}}}:tpm_sum") > 0
    finally:
        await redis.aclose()


async def test_a_fallback_is_charged_its_own_price_and_only_for_keys_allowed_to_use_it(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    """`cheap` fails (nothing listens at its base_url) and falls back to `pricey`: the answer costs what `pricey`
    costs (7 × 100 + 3 × 100 = 1,000 micro-dollars, not cheap's 1), so the budget stops the second request; a key
    restricted to `cheap` is never served (nor charged) by `pricey`, as it could not ask for it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # closed again below: connecting is refused
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    down = {**up, "base_url": f"http://127.0.0.1:{closed_port}/v1", "name": "down"}
    models = [
        {"id": "cheap", "deployments": [down], "pricing": {"input_per_mtok": 0.1, "output_per_mtok": 0.1}},
        {"id": "pricey", "deployments": [up], "pricing": {"input_per_mtok": 100, "output_per_mtok": 100}},
    ]
    with gateway_instances(redis_url, tmp_path, models, fallbacks={"cheap": ["pricey"]}) as (a, b):
        async with httpx.AsyncClient(timeout=30) as client:
            # Every request holds its worst case at the dearest model that may serve it, pricey's: 30 tokens × 100
            # = 3,000 micro-dollars (cheap's would be 3), so a budget of 4,500 admits two and spends 2,000.
            key_id, user = await create_key(client, a.url, budget_usd=0.0045)
            statuses = [
                await send(client, (a, b)[i % 2].url, "chat", user, stream=i == 1, model="cheap") for i in range(3)
            ]
            assert statuses == [200, 200, 429]  # 0 → 1,000 → 2,000, then 2,000 + 3,000 > 4,500
            record = await settled_record(client, a.url, key_id, 2)
            assert record["spend_usd"] == pytest.approx(2e-3)

            narrow_id, narrow = await create_key(client, a.url, models=["cheap"], budget_usd=1)
            path, payload = body("chat", stream=False, model="cheap")
            refused = await client.post(b.url + path, json=payload, headers=narrow)
            # `cheap` failed max_fails times on each instance above, so it is cooling down; nothing else may answer.
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "upstream_cooling_down"
            record = await settled_record(client, a.url, narrow_id, 1)
    assert record["spend_usd"] == 0 and len(fake_upstream.requests) == 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("usage", [{}, {"total_tokens": 50}], ids=["no-counts", "total-only"])
async def test_an_answer_without_token_counts_is_charged_an_estimate_not_nothing(
    gateways: tuple[ThreadedServer, ThreadedServer],
    fake_upstream: FakeUpstream,
    family: str,
    stream: bool,
    usage: dict[str, Any],
) -> None:
    """An upstream whose usage has no prompt/completion counts must not make budgets and TPM free: the prompt
    estimate ("hi": 1 token) plus the answer's characters / 4 is charged, or its `total_tokens` when it gave one."""
    fake_upstream.behave(usage=usage)
    a, _ = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await create_key(client, a.url, token_budget=1000)
        assert await send(client, a.url, family, user, stream=stream) == 200
        record = await settled_record(client, a.url, key_id, 1)
    # Streams send "t0 t1 t2 " (9 characters: 3 tokens); answers "Hello from the fake upstream" (28: 7 tokens).
    expected = 50 if usage else 1 + (3 if stream else 7)
    assert record["tokens_spent"] == expected


async def test_a_list_of_prompts_reserves_its_whole_output_and_is_capped(
    gateways: tuple[ThreadedServer, ThreadedServer],
) -> None:
    """Each of a /v1/completions request's prompts gets `n` choices of up to `max_tokens`: 10 prompts × n 2 ×
    100 tokens reserve 2,000 against a TPM of 1,000 (one prompt with the same n and max_tokens fits), and more than
    128 completions in one request (prompts × n) are refused before anything is reserved."""
    a, _ = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        _, user = await create_key(client, a.url, tpm=1000)
        one = {"model": "gpt-test", "prompt": "Hi", "n": 2, "max_tokens": 100}
        many = {**one, "prompt": ["Hi"] * 10}
        tokens = {**one, "prompt": [[1, 2, 3]] * 10}
        assert (await client.post(f"{a.url}/v1/completions", json=one, headers=user)).status_code == 200
        for body in (many, tokens):
            refused = await client.post(f"{a.url}/v1/completions", json=body, headers=user)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "tokens_limit_exceeded"
        too_many = await client.post(f"{a.url}/v1/completions", json={**many, "prompt": ["Hi"] * 65}, headers=user)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt", too_many.text
    assert "130 completions" in too_many.json()["error"]["message"]


@pytest.mark.parametrize("family", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_anthropic_answer_without_usage_is_charged_an_estimate_through_a_translation(
    redis_url: str, tmp_path: Path, family: str, stream: bool
) -> None:
    """Translated to chat, an Anthropic answer without usage must not read as 0 tokens (it did: budgets were
    free); the estimate is charged: "hi" (1 token) + "Hello from fake" (15 characters: 4 tokens)."""
    claude = ThreadedServer(FakeAnthropic().app(), lifespan="off").start()
    deployment = {"type": "anthropic", "base_url": claude.url + "/v1", "api_key": UPSTREAM_KEY}
    try:
        with gateway_instances(redis_url, tmp_path, [{"id": "claude-nousage", "deployments": [deployment]}]) as (a, _):
            async with httpx.AsyncClient(timeout=30) as client:
                key_id, user = await create_key(client, a.url, token_budget=1000)
                assert await send(client, a.url, family, user, stream=stream, model="claude-nousage") == 200
                record = await settled_record(client, a.url, key_id, 1)
    finally:
        claude.stop()
    assert record["tokens_spent"] == 1 + 4
