"""The request log end to end: requests through gateway A, their records read back through gateway B (one Redis,
whatever topology the session runs), after every way a request can end — success, an upstream error, a retry then
a fallback, our own 429, the client leaving before and after the first byte, a stream cut by the upstream — and
never a word of the prompt or the answer in them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.server import ThreadedServer
from fakes.upstream import PROMPT_TOKENS, Behavior, FakeUpstream
from typer.testing import CliRunner

from gateway.cli import app as cli_app

ADMIN = {"authorization": f"Bearer {MASTER}"}
SECRET_PROMPT = "the launch code is 0000 zebra"
PRICING = {"input_per_mtok": 1, "output_per_mtok": 2}


def chat(model: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": SECRET_PROMPT}], **fields}


@pytest.fixture
def gateways(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[list[ThreadedServer]]:
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-upstream-SECRET-1", "name": "up"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nothing listens here once the socket is closed
    down = {**up, "base_url": f"http://127.0.0.1:{closed_port}/v1", "name": "down"}
    models = [
        {"id": "m", "deployments": [up], "pricing": PRICING},
        {"id": "flaky", "deployments": [down], "pricing": PRICING},
    ]
    with gateway_instances(redis_url, tmp_path, models, fallbacks={"flaky": ["m"]}) as servers:
        yield servers


async def new_key(client: httpx.AsyncClient, url: str, **fields: Any) -> tuple[str, dict[str, str]]:
    response = await client.post(f"{url}/admin/keys", json={"name": "log-test", **fields}, headers=ADMIN)
    assert response.status_code == 201, response.text
    data = response.json()
    return data["id"], {"authorization": f"Bearer {data['key']}"}


async def record_of(client: httpx.AsyncClient, url: str, request_id: str) -> dict[str, Any]:
    """The record as the other instance reads it, once the writer's batch is in (a bounded wait)."""
    for _ in range(200):
        response = await client.get(f"{url}/admin/requests/{request_id}", headers=ADMIN)
        if response.status_code == 200:
            return dict(response.json())
        assert response.status_code == 404, response.text
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record for {request_id}")


def assert_no_text(record: dict[str, Any]) -> None:
    text = str(record)
    assert "launch code" not in text and "zebra" not in text and "t0 " not in text and "SECRET" not in text


async def test_success_error_and_fallback_are_recorded_and_read_from_another_instance(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await new_key(client, a.url)

        ok = await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers=user)
        assert ok.status_code == 200
        record = await record_of(client, b.url, ok.headers["x-request-id"])
        assert record["key_id"] == key_id and record["key_name"] == "log-test"
        assert (record["api"], record["route"], record["model"], record["deployment"]) == (
            "openai",
            "/v1/chat/completions",
            "m",
            "up",
        )
        assert (record["status"], record["code"], record["ended_by"], record["stream"]) == (
            200,
            None,
            "finished",
            False,
        )
        assert [(x["deployment"], x["status"]) for x in record["attempts"]] == [("up", 200)]
        usage = ok.json()["usage"]
        assert record["usage"] == {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": 0,
            "estimated": False,
        }
        cost = (usage["prompt_tokens"] * 1 + usage["completion_tokens"] * 2) / 1_000_000
        assert float(record["cost_usd"]) == pytest.approx(cost)
        assert record["duration_ms"] > 0 and record["fallback"] is None
        assert_no_text(record)

        fake_upstream.queue(Behavior(mode="status", status=400))
        bad = await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers=user)
        assert bad.status_code == 400
        record = await record_of(client, b.url, bad.headers["x-request-id"])
        assert (record["status"], record["ended_by"]) == (400, "error") and record["code"]
        assert [(x["deployment"], x["status"]) for x in record["attempts"]] == [("up", 400)]

        fell_back = await client.post(f"{a.url}/v1/chat/completions", json=chat("flaky"), headers=user)
        assert fell_back.status_code == 200, fell_back.text
        record = await record_of(client, b.url, fell_back.headers["x-request-id"])
        assert (record["model"], record["fallback"], record["deployment"]) == ("flaky", "m", "up")
        attempts = [(x["deployment"], x["status"]) for x in record["attempts"]]
        assert attempts[-1] == ("up", 200) and len(attempts) >= 2
        first, last = record["attempts"][0], record["attempts"][-1]
        assert 0 < first["start_ms"] and first["start_ms"] + first["duration_ms"] <= last["start_ms"]
        assert last["start_ms"] + last["duration_ms"] <= record["duration_ms"]
        assert all(
            d == "down" and s != 200 and x["code"] for (d, s), x in zip(attempts[:-1], record["attempts"], strict=False)
        )

        listed = (await client.get(f"{b.url}/admin/requests", params={"key": key_id}, headers=ADMIN)).json()["data"]
        assert [r["request_id"] for r in listed] == [
            fell_back.headers["x-request-id"],
            bad.headers["x-request-id"],
            ok.headers["x-request-id"],
        ]
        only_400 = await client.get(f"{b.url}/admin/requests", params={"status": 400}, headers=ADMIN)
        assert [r["request_id"] for r in only_400.json()["data"]] == [bad.headers["x-request-id"]]


async def test_our_own_429_is_recorded_with_no_attempt(gateways: list[ThreadedServer]) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        _, user = await new_key(client, a.url, rpm=1)
        assert (await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers=user)).status_code == 200
        limited = await client.post(f"{b.url}/v1/chat/completions", json=chat(), headers=user)
        assert limited.status_code == 429
        record = await record_of(client, a.url, limited.headers["x-request-id"])
        assert (record["status"], record["code"], record["ended_by"]) == (429, "rate_limit_exceeded", "error")
        assert record["attempts"] == [] and record["deployment"] is None
        assert record["usage"]["prompt_tokens"] == 0 and record["cost_usd"] == "0"


async def test_a_client_leaving_before_the_first_byte_is_recorded(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    a, b = gateways
    fake_upstream.behave(mode="hang", hold_s=30)
    async with httpx.AsyncClient(timeout=30) as client:
        _, user = await new_key(client, a.url)
        headers = {**user, "x-request-id": "leaves-early-1"}
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=0.5)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post(f"{a.url}/v1/chat/completions", json=chat(), headers=headers)
        record = await record_of(client, b.url, "leaves-early-1")
    assert (record["status"], record["code"], record["ended_by"]) == (499, "client_disconnected", "client_left")
    assert record["ttft_ms"] is None


async def test_a_client_leaving_mid_stream_and_a_cut_stream_are_recorded(
    gateways: list[ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    a, b = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        _, user = await new_key(client, a.url)
        fake_upstream.behave(mode="slow", inter_token_s=0.2, num_chunks=50)
        headers = {**user, "x-request-id": "leaves-mid-stream-1"}
        async with client.stream(
            "POST", f"{a.url}/v1/chat/completions", json=chat(stream=True), headers=headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break  # the first chunk: now leave
        record = await record_of(client, b.url, "leaves-mid-stream-1")
        assert (record["status"], record["ended_by"], record["stream"]) == (200, "client_left", True)
        assert record["ttft_ms"] is not None and record["ttft_ms"] <= record["duration_ms"]
        assert record["usage"]["estimated"] is True and record["usage"]["prompt_tokens"] >= 1
        assert_no_text(record)

        release = threading.Event()
        release.set()
        fake_upstream.behave(mode="stream_cut", cut_after=2, cut_when=release)
        cut = await client.post(f"{a.url}/v1/chat/completions", json=chat(stream=True), headers=user)
        assert cut.status_code == 200
        record = await record_of(client, b.url, cut.headers["x-request-id"])
        assert (record["status"], record["ended_by"]) == (200, "error") and record["code"]
        assert record["stream"] is True and record["ttft_ms"] is not None


async def test_unverified_requests_are_not_logged_and_the_api_checks_its_input(gateways: list[ThreadedServer]) -> None:
    a, _ = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        nobody = await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers={"authorization": "Bearer x"})
        assert nobody.status_code == 401
        await asyncio.sleep(0.5)  # two flush intervals
        missing = await client.get(f"{a.url}/admin/requests/{nobody.headers['x-request-id']}", headers=ADMIN)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
        for params in ({"status": "abc"}, {"since": "yesterday"}, {"cursor": "x"}, {"limit": "0"}, {"after": "-"}):
            response = await client.get(f"{a.url}/admin/requests", params=params, headers=ADMIN)
            assert response.status_code == 400, params
        _, user = await new_key(client, a.url)
        assert (await client.get(f"{a.url}/admin/requests", params={"key": "master"}, headers=user)).status_code == 403


async def test_the_cli_lists_shows_and_tails(gateways: list[ThreadedServer]) -> None:
    a, _ = gateways
    async with httpx.AsyncClient(timeout=30) as client:
        key_id, user = await new_key(client, a.url)
        sent = await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers=user)
        request_id = sent.headers["x-request-id"]
        await record_of(client, a.url, request_id)
    runner = CliRunner()
    env = {"UNIGATE_BASE_URL": a.url, "UNIGATE_MASTER_KEY": MASTER}

    def run(*args: str) -> str:
        result = runner.invoke(cli_app, list(args), env=env)
        assert result.exit_code == 0, result.output
        return result.output

    listed = await asyncio.to_thread(run, "requests", "list", "--key", key_id)
    lines = listed.strip().splitlines()
    assert lines[0].split("\t")[:3] == ["time", "request_id", "key"] and request_id in lines[1]
    shown = await asyncio.to_thread(run, "requests", "show", request_id, "--json")
    assert f'"request_id": "{request_id}"' in shown and f'"prompt_tokens": {PROMPT_TOKENS}' in shown

    async def send_later() -> str:
        await asyncio.sleep(1.0)
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.post(f"{a.url}/v1/chat/completions", json=chat(), headers=user)
            return response.headers["x-request-id"]

    tailing = asyncio.create_task(asyncio.to_thread(run, "requests", "tail", "--count", "1", "--interval", "0.1"))
    later_id = await send_later()
    tailed = await asyncio.wait_for(tailing, 30)
    assert later_id in tailed and request_id not in tailed
    with contextlib.suppress(Exception):
        tailing.cancel()


async def test_with_the_log_off_nothing_is_written_and_the_api_says_so(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    from gateway.server import build_app
    from gateway.settings import Settings

    routing = tmp_path / "unigate.yaml"
    routing.write_text(
        f"models:\n  - id: m\n    deployments:\n      - {{type: openai, base_url: '{fake_upstream.base_url}'}}\n"
    )
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        engine={"enabled": False},  # type: ignore[arg-type]
        health_probe_interval_s=0,
        request_log={"enabled": False},  # type: ignore[arg-type]
    )
    server = ThreadedServer(build_app(settings)).start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            sent = await client.post(f"{server.url}/v1/chat/completions", json=chat(), headers=ADMIN)
            assert sent.status_code == 200
            off = await client.get(f"{server.url}/admin/requests", headers=ADMIN)
            assert off.status_code == 503 and off.json()["error"]["code"] == "service_unavailable"
    finally:
        server.stop()
    import redis as redis_sync

    if "cluster" not in redis_url and "sentinel" not in redis_url:
        with redis_sync.Redis.from_url(redis_url) as check:
            assert check.exists("ug:{reqlog}:log") == 0
