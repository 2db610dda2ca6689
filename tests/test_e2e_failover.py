"""Redis failing over under load: two real gateway instances (production wiring) and a fake upstream, steady client
traffic, and the Redis primary failed over mid-load — by Sentinel (`SENTINEL FAILOVER`, or the primary killed) or,
in a Redis Cluster, by the slot's replica (`CLUSTER FAILOVER`).

Measured and printed: requests that failed and for how long, requests served without their limits (the failure
mode's bypass for keys verified moments before), how long /health/ready said 503. Checked: the gateways follow the
new primary by themselves, no request hangs, usage recorded before the failover is still there afterwards, and RPM,
concurrency and budget limits are exact again across both instances.

The durability guarantee under test: usage that the replica has acknowledged (here: `WAIT 1` right after the
snapshot, which is what a replica that keeps up gives within milliseconds) survives the failover. Replication is
asynchronous, so writes of the last few milliseconds before an unplanned failover can be lost; `appendfsync always`
on the primary covers a restart of the primary itself, not a failover. A planned failover (Sentinel closes the
gateway's connections as it starts; a cluster's replica waits for the master's writes) loses nothing acknowledged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.redis_topologies import LocalCluster, LocalSentinel, RedisProcess
from fakes.server import ThreadedServer
from fakes.upstream import PROMPT_TOKENS, FakeUpstream
from redis.crc import key_slot

from auth import redis_names
from gateway.estimates import prompt_token_bound

ADMIN = {"authorization": f"Bearer {MASTER}"}
USED = PROMPT_TOKENS + 3  # tokens the fake upstream reports per request (prompt + 3 completion tokens)
NUM_CLIENTS = 6
MAX_INTERRUPTION_S = 5.0
MAX_LATENCY_S = 5.0  # no request may hang: Redis calls time out after 1 s


def chat() -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@dataclass
class Sample:
    started: float
    ended: float
    status: int
    code: str = ""  # the error code of a failed request


@dataclass
class LoadLog:
    samples: list[Sample] = field(default_factory=list)
    health: list[tuple[float, int]] = field(default_factory=list)
    bypasses: list[tuple[float, int]] = field(default_factory=list)  # (time, requests served without limits so far)
    is_running: bool = True

    @property
    def num_ok(self) -> int:
        return sum(1 for s in self.samples if s.status == 200)

    def failures(self) -> list[Sample]:
        return [s for s in self.samples if s.status != 200]


async def _client_loop(client: httpx.AsyncClient, urls: list[str], user: dict[str, str], log: LoadLog, n: int) -> None:
    i = n
    while log.is_running:
        started = time.monotonic()
        try:
            response = await client.post(f"{urls[i % 2]}/v1/chat/completions", json=chat(), headers=user)
            status = response.status_code
            code = "" if status == 200 else response.json().get("error", {}).get("code", "")
        except httpx.HTTPError as exc:
            status, code = 0, type(exc).__name__
        log.samples.append(Sample(started, time.monotonic(), status, code))
        i += 1
        if status != 200:
            await asyncio.sleep(0.02)  # a client backing off after an error


async def _health_loop(client: httpx.AsyncClient, url: str, log: LoadLog, count_bypasses: Callable[[], int]) -> None:
    while log.is_running:
        response = await client.get(f"{url}/health/ready")
        log.health.append((time.monotonic(), response.status_code))
        log.bypasses.append((time.monotonic(), count_bypasses()))
        await asyncio.sleep(0.05)


def _window(times: list[float]) -> float:
    return max(times) - min(times) if times else 0.0


class _LimitsBack:
    """True once `n` more requests were served after the last one served without limits."""

    def __init__(self, log: LoadLog, count_bypasses: Callable[[], int], n: int) -> None:
        self.log, self.count_bypasses, self.n = log, count_bypasses, n
        self.last = (-1, 0)  # (bypasses, requests served when that count was first seen)

    def __call__(self) -> bool:
        bypasses = self.count_bypasses()
        if bypasses != self.last[0]:
            self.last = (bypasses, self.log.num_ok)
        return self.log.num_ok - self.last[1] >= self.n


async def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def create_key(client: httpx.AsyncClient, url: str, **fields: Any) -> tuple[str, dict[str, str]]:
    response = await client.post(f"{url}/admin/keys", json=fields, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    return response.json()["id"], {"authorization": f"Bearer {response.json()['key']}"}


async def _until_a_new_key_works(client: httpx.AsyncClient, urls: list[str], timeout_s: float = 5.0) -> float:
    """Seconds until a key created now is served by every instance (its request admitted through the connection
    that carried every settle queued before it)."""
    started = time.monotonic()
    while True:
        response = await client.post(f"{urls[0]}/admin/keys", json={}, headers=ADMIN)
        if response.status_code in (200, 201):
            user = {"authorization": f"Bearer {response.json()['key']}"}
            statuses = [
                (await client.post(f"{url}/v1/chat/completions", json=chat(), headers=user)).status_code for url in urls
            ]
            if statuses == [200] * len(urls):
                return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, f"new keys still fail: {response.text[:300]}"
        await asyncio.sleep(0.1)


def _num_requests(node: RedisProcess, key_id: str) -> int:
    return int(node.command("HGET", redis_names.key_record(key_id), "num_requests") or 0)


class SentinelSetup:
    def __init__(self, directory: Path, how: str) -> None:
        self.redis = LocalSentinel(directory)
        self.how = how

    def start(self) -> str:
        return self.redis.start()

    def primary_for(self, key_id: str) -> RedisProcess:
        return self.redis.primary

    def sync(self, key_id: str) -> None:
        assert self.redis.sync_replica() == 1, "the replica did not acknowledge the writes"

    def fail_over(self, key_id: str) -> RedisProcess:
        if self.how == "sentinel_failover":
            return self.redis.failover()
        old = self.redis.primary
        old.stop(kill=True)  # a crash: Sentinel notices after down-after-milliseconds (1 s)
        return self.redis.wait_promoted(old)

    def stop(self) -> None:
        self.redis.stop()


class ClusterSetup:
    def __init__(self, directory: Path) -> None:
        self.redis = LocalCluster(directory, replicas=1, fsync_always=True)

    def start(self) -> str:
        return self.redis.start()

    def primary_for(self, key_id: str) -> RedisProcess:
        return self.redis.master_of_slot(key_slot(redis_names.key_record(key_id).encode()))

    def sync(self, key_id: str) -> None:
        assert int(self.primary_for(key_id).command("WAIT", 1, 2000)) == 1

    def fail_over(self, key_id: str) -> RedisProcess:
        return self.redis.failover(self.primary_for(key_id))

    def stop(self) -> None:
        self.redis.stop()


@pytest.fixture(params=["sentinel_failover", "primary_killed", "cluster_failover"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SentinelSetup | ClusterSetup]:
    topology = ClusterSetup(tmp_path / "redis") if request.param == "cluster_failover" else None
    chosen = topology or SentinelSetup(tmp_path / "redis", request.param)
    chosen.start()
    yield chosen
    chosen.stop()


@pytest.fixture
def gateways(
    setup: SentinelSetup | ClusterSetup, tmp_path: Path, fake_upstream: FakeUpstream
) -> Iterator[tuple[ThreadedServer, ThreadedServer]]:
    url = setup.redis.url
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-up"}
    with gateway_instances(url, tmp_path, [{"id": "gpt-test", "deployments": [deployment]}]) as (a, b):
        yield a, b


def _access(server: ThreadedServer) -> Any:
    return server.server.config.app.state.access


async def test_gateways_follow_a_failover_under_load(
    setup: SentinelSetup | ClusterSetup, gateways: tuple[ThreadedServer, ThreadedServer], fake_upstream: FakeUpstream
) -> None:
    a, b = gateways
    urls = [a.url, b.url]
    log = LoadLog()
    async with httpx.AsyncClient(timeout=10) as client:
        key_id, user = await create_key(client, a.url, name="load", rpm=1_000_000, max_concurrent=64)
        load = [asyncio.create_task(_client_loop(client, urls, user, log, n)) for n in range(NUM_CLIENTS)]

        def count_bypasses() -> int:
            return sum(_access(s).num_limit_bypasses for s in gateways)

        load.append(asyncio.create_task(_health_loop(client, a.url, log, count_bypasses)))
        try:
            await _wait_for(lambda: log.num_ok >= 100, 20, "100 requests served before the failover")
            old_primary = setup.primary_for(key_id)
            recorded_before = _num_requests(old_primary, key_id)
            setup.sync(key_id)  # every write so far, this snapshot's included, is on the replica

            bypasses_before = sum(_access(s).num_limit_bypasses for s in gateways)
            started = time.monotonic()
            new_primary = await asyncio.get_running_loop().run_in_executor(None, setup.fail_over, key_id)
            promoted_after_s = time.monotonic() - started
            # Traffic goes on until the gateways have served 200 requests in a row with their limits checked.
            await _wait_for(_LimitsBack(log, count_bypasses, 200), 30, "200 requests with limits after the failover")
        finally:
            log.is_running = False
            await asyncio.gather(*load)

        bypasses = sum(_access(s).num_limit_bypasses for s in gateways) - bypasses_before
        failures = log.failures()
        window = (min(s.started for s in failures), max(s.ended for s in failures)) if failures else (0.0, 0.0)
        interruption_s = window[1] - window[0]
        slowest_s = max(s.ended - s.started for s in log.samples)
        unready = [t for t, status in log.health if status != 200]
        unready_s = _window(unready)
        bypass_times = [t for (t, n), (_, before) in zip(log.bypasses[1:], log.bypasses, strict=False) if n > before]
        bypass_s = _window(bypass_times)
        name = getattr(setup, "how", "cluster_failover")
        codes = sorted({f"{s.status} {s.code}" for s in failures})
        print(
            f"\n[{name}] {len(log.samples)} requests, {len(failures)} failed {codes} over {interruption_s:.2f} s; "
            f"{bypasses} served without limits (over {bypass_s:.2f} s); slowest {slowest_s:.2f} s; new primary "
            f"named after {promoted_after_s:.2f} s; /health/ready 503 for {unready_s:.2f} s ({len(unready)} probes)"
        )
        assert interruption_s < MAX_INTERRUPTION_S
        assert slowest_s < MAX_LATENCY_S, "a request hung on Redis"
        assert log.health[-1][1] == 200, "/health/ready did not recover"

        # Nothing recorded before the failover is lost, and the gateways record on the new primary. A request of
        # another key on each instance is admitted through the same connection after every settle queued there.
        # (Like any client after a 503 with Retry-After, it tries again until a new key works on both instances.)
        waited_s = await _until_a_new_key_works(client, urls)
        print(f"a new key worked on both instances {waited_s:.2f} s after the load stopped")
        served = log.num_ok
        recorded_after = _num_requests(new_primary, key_id)
        print(
            f"usage: {recorded_before} requests recorded before the failover, {recorded_after} after; {served} "
            f"served, {served - recorded_after} of them unrecorded ({bypasses} served without limits)"
        )
        assert recorded_before <= recorded_after <= served

        # Limits are exact again, across both instances.
        _, rpm_user = await create_key(client, b.url, rpm=5)
        statuses = [
            (await client.post(f"{urls[i % 2]}/v1/chat/completions", json=chat(), headers=rpm_user)).status_code
            for i in range(9)
        ]
        assert statuses == [200] * 5 + [429] * 4

        # Hard budgets hold each request's worst case while it runs (the prompt bound + max_tokens): a budget of
        # one worst case and one request's usage admits two requests one after another, then refuses.
        worst = prompt_token_bound("chat/completions", chat()) + chat()["max_tokens"]
        _, budget_user = await create_key(client, a.url, token_budget=USED + worst)
        statuses = [
            (await client.post(f"{urls[i % 2]}/v1/chat/completions", json=chat(), headers=budget_user)).status_code
            for i in range(4)
        ]
        assert statuses == [200, 200, 429, 429]

        _, slow_user = await create_key(client, a.url, max_concurrent=2)
        fake_upstream.behave(mode="slow", ttft_s=0.5)
        responses = await asyncio.gather(
            *(client.post(f"{urls[i % 2]}/v1/chat/completions", json=chat(), headers=slow_user) for i in range(6))
        )
        fake_upstream.behave()
        codes = sorted(r.status_code for r in responses)
        assert codes == [200, 200, 429, 429, 429, 429], [r.text[:200] for r in responses]
        assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {"concurrency_limit_exceeded"}
