"""The local engine shared by the gateway's callers (issue 38), end to end: a real gateway on loopback with real
Redis and a tiny local model, in process and through the engine host (`unigate serve --workers N`'s path: the
gateway's deployment is an `EngineClient` of an `EngineHost` on a Unix socket).

- Each key's requests reach the engine under the key's own tenant, with the key's weight: `/admin/engine` lists
  them per tenant (`tenants`, `waiting_by_tenant`, `running_by_tenant`).
- A client that leaves a local stream before its usage chunk is charged the engine's own counts (every prompt token,
  the cached ones too, and what was generated), not an estimate: the issue's 1,500 CJK characters were charged 376
  prompt tokens (characters / 4), then the byte bound, never the real count.
- A client that leaves an upstream stream before its usage chunk is charged an estimate, and its usage row says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.engine_host import ThreadedEngineHost, tiny_local_backend
from fakes.instances import gateway_instances
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from gateway.server import build_app
from gateway.settings import Settings

pytestmark = pytest.mark.timeout(240)

ADMIN = {"authorization": f"Bearer {MASTER}"}
# Two seats: three long streams of two keys always leave one of them waiting. Room for a 4,500-token prompt.
ENGINE: dict[str, Any] = {
    "device": "cpu",
    "kv_cache_memory": 16 * 2**20,
    "max_num_seqs": 2,
    "cpu_kernels": False,
    "pack_cpu_weights": False,
}
CJK = "漢字かな交じり文の試験です。" * 107 + "終了"  # 1,500 characters, 4,500 UTF-8 bytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=8192)


@pytest.fixture(params=["in_process", "engine_host"])
def gateway(request: pytest.FixtureRequest, redis_url: str, tmp_path: Path, checkpoint: Path) -> Iterator[str]:
    """The gateway's URL: its local model served in its own process, or by an engine host on a Unix socket."""
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        engine={**ENGINE, "model_path": str(checkpoint)},  # type: ignore[arg-type]
    )
    if request.param == "in_process":
        with ThreadedServer(build_app(settings)) as server:
            yield server.url
        return
    directory = Path(tempfile.mkdtemp(prefix="ug-"))  # (a socket path must be short)
    try:
        backend = tiny_local_backend(checkpoint, tmp_path / "engine", **ENGINE)
        with ThreadedEngineHost(backend, directory / "engine.sock"):
            sockets = {f"{settings.engine.model_id}#0": str(directory / "engine.sock")}
            with ThreadedServer(build_app(settings.with_engine_sockets(sockets))) as server:
                yield server.url
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def create_key(client: httpx.AsyncClient, **fields: Any) -> tuple[str, dict[str, str]]:
    response = await client.post("/admin/keys", json=fields, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    return response.json()["id"], {"authorization": f"Bearer {response.json()['key']}"}


async def engine(client: httpx.AsyncClient) -> dict[str, Any]:
    """The local engine's stats once its model is loaded (through the engine host: as its last poll saw them)."""
    for _ in range(600):
        [stats] = (await client.get("/admin/engine", headers=ADMIN)).json()["data"]
        if stats.get("loaded"):
            return dict(stats)
        await asyncio.sleep(0.1)
    raise AssertionError("the local model did not load")


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": "local", "messages": [{"role": "user", "content": content}], **fields}


async def drain(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> None:
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for _ in response.aiter_bytes():
            pass


@contextlib.asynccontextmanager
async def running(jobs: list[Any]) -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks = [asyncio.create_task(job) for job in jobs]
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()  # the client leaves: the engine aborts the stream
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_each_keys_requests_share_the_engine_under_its_own_tenant_and_weight(gateway: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        await engine(client)
        a_id, a = await create_key(client, name="a", weight=3)
        b_id, b = await create_key(client, name="b")
        long = chat("tell me everything", max_tokens=3000, min_tokens=3000)
        seen: dict[str, Any] = {}
        async with running([drain(client, long, a), drain(client, long, a), drain(client, long, b)]) as tasks:
            for _ in range(600):  # until a snapshot shows both keys in the engine, one sequence waiting
                stats = await engine(client)
                waiting, active = stats["waiting_by_tenant"], stats["running_by_tenant"]
                if set(waiting) | set(active) == {a_id, b_id} and sum(waiting.values()) == 1:
                    seen = stats
                    break
                assert not any(task.done() for task in tasks), "a stream ended before the engine was seen full"
                await asyncio.sleep(0.05)
        assert seen, "the engine never showed both keys' sequences with one waiting"
        assert sum(seen["running_by_tenant"].values()) == 2
        tenants = seen["tenants"]
        assert tenants[a_id]["weight"] == 3.0 and tenants[b_id]["weight"] == 1.0  # the key's weight reached it
        for _ in range(600):  # (through the engine host, its next poll brings the last tokens in)
            served = (await engine(client))["tenants"]
            if served[a_id]["served_tokens"] > 0 and served[b_id]["served_tokens"] > 0:
                break
            await asyncio.sleep(0.1)
        assert served[a_id]["served_tokens"] > 0 and served[b_id]["served_tokens"] > 0
        assert "" not in served and "master" not in served  # every token was served to a key


async def test_a_burst_of_one_key_does_not_hold_another_keys_request_behind_it(gateway: str) -> None:
    """Today's bug (the burst): every gateway request was the same tenant to the engine, so B's short request
    waited behind all of A's queued streams. Now B is seated at once: it finishes while none of A's streams has."""
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        await engine(client)
        _, a = await create_key(client, name="a")
        _, b = await create_key(client, name="b")
        started = asyncio.Event()

        async def a_stream() -> None:
            body = chat("a long answer", max_tokens=2000, min_tokens=2000, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=a) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    started.set()

        async with running([a_stream() for _ in range(10)]) as tasks:  # two seats: eight of A's wait
            await started.wait()
            await drain(client, chat("short", max_tokens=4, stream=True), b)
            num_a_done = sum(task.done() for task in tasks)
            assert not any(task.done() and task.exception() for task in tasks)
    assert num_a_done == 0  # first come, first served: B would have waited for eight of A's streams to end


async def test_a_teams_keys_share_the_teams_tenant_and_weight(gateway: str) -> None:
    """Tenant = the team, else the key: two keys of one team are one tenant, with the team's weight."""
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        await engine(client)
        team = await client.post("/admin/teams", json={"name": "search", "weight": 2}, headers=ADMIN)
        assert team.status_code in (200, 201), team.text
        team_id = team.json()["id"]
        _, first = await create_key(client, name="t1", team_id=team_id)
        _, second = await create_key(client, name="t2", team_id=team_id, weight=5)  # (the team's weight applies)
        solo_id, solo = await create_key(client, name="solo")
        long = chat("tell me everything", max_tokens=3000, min_tokens=3000)
        seen: dict[str, Any] = {}
        async with running([drain(client, long, first), drain(client, long, second), drain(client, long, solo)]):
            for _ in range(600):
                stats = await engine(client)
                waiting, active = stats["waiting_by_tenant"], stats["running_by_tenant"]
                if set(waiting) | set(active) == {team_id, solo_id} and sum(waiting.values()) == 1:
                    seen = stats
                    break
                await asyncio.sleep(0.05)
    assert seen, "the engine never showed the team's and the solo key's sequences with one waiting"
    assert seen["tenants"][team_id]["weight"] == 2.0 and seen["tenants"][solo_id]["weight"] == 1.0


async def test_a_cut_cjk_stream_is_charged_the_engines_exact_counts(gateway: str) -> None:
    """Today's bug: a client that left after the first chunk was charged an estimate of the prompt (376 tokens for
    4,028 real ones with the bundled model; the tiny model's byte-level tokenizer counts about one per byte)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as client:
        await engine(client)
        # The engine's own count of this prompt, and its prefix in the cache from now on.
        primed = await client.post("/v1/chat/completions", json=chat(CJK, max_tokens=1), headers=ADMIN)
        assert primed.status_code == 200, primed.text
        num_prompt = primed.json()["usage"]["prompt_tokens"]
        assert num_prompt >= len(CJK.encode())  # (the tiny tokenizer: about a token per byte)
        key_id, user = await create_key(client, name="cut")
        body = chat(CJK, max_tokens=2000, min_tokens=2000, stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=user) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break  # the first chunk: the client leaves
        for _ in range(600):  # the settle lands just after the stream closed
            record = (await client.get(f"/admin/keys/{key_id}", headers=ADMIN)).json()
            if record["num_requests"]:
                break
            await asyncio.sleep(0.1)
        usage = (await client.get(f"/admin/keys/{key_id}/usage", headers=ADMIN)).json()["data"]
        for _ in range(600):  # (through the engine host: once its next poll came)
            if (hit_rate := (await engine(client))["prefix_cache_hit_rate"]) > 0:
                break
            await asyncio.sleep(0.1)
    assert record["prompt_tokens"] == num_prompt  # exact: every prompt token, the cached ones included
    assert 1 <= record["completion_tokens"] < 2000  # what the engine generated before the client left
    assert sum(row["estimated_requests"] for row in usage) == 0
    assert hit_rate > 0  # (the cut request's prompt was served from the cache in part)


@pytest.fixture
def upstream_gateway(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[str]:
    up = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    with gateway_instances(redis_url, tmp_path, [{"id": "gpt-test", "deployments": [up]}], names=("a",)) as [server]:
        yield server.url


async def test_a_client_that_leaves_an_upstream_stream_early_is_charged_an_estimate_marked_so(
    upstream_gateway: str, fake_upstream: FakeUpstream
) -> None:
    """An upstream stream cut by its client before the usage chunk: the upstream's counts never came, so the prompt
    bound and the text seen are charged, and the usage row counts the request as estimated."""
    fake_upstream.behave(num_chunks=200, inter_token_s=0.05)
    async with httpx.AsyncClient(base_url=upstream_gateway, timeout=60) as client:
        key_id, user = await create_key(client, name="leaves")
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": CJK}], "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=user) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break
        for _ in range(600):
            record = (await client.get(f"/admin/keys/{key_id}", headers=ADMIN)).json()
            if record["num_requests"]:
                break
            await asyncio.sleep(0.1)
        usage = (await client.get(f"/admin/keys/{key_id}/usage", headers=ADMIN)).json()["data"]
    assert record["prompt_tokens"] >= len(CJK.encode())  # the bound, never below the real count
    assert sum(row["estimated_requests"] for row in usage) == 1
