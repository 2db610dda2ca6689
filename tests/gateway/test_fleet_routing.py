"""Each `routing:` policy against a simulated fleet (tests/fakes/replica_sim.py), through real gateways."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fakes.app import AUTH, asgi_client, build_app
from fakes.replica_sim import ReplicaFleet, SimParams

SYSTEM = "You are a coding agent working in a large repository. Follow the rules below exactly. " * 30
FAST = SimParams(time_scale=0.05, default_max_tokens=4)
POLL = {"metrics_interval_s": 0.05, "metrics_timeout_s": 0.2, "metrics_stale_s": 30}


@pytest.fixture
def fleet() -> Iterator[ReplicaFleet]:
    with ReplicaFleet(4, FAST) as fleet:
        yield fleet


def routing(fleet: ReplicaFleet, policy: str, *, metrics: bool = True, **model: Any) -> dict[str, Any]:
    deployments = [
        {
            "type": "openai",
            "name": f"r{i}",
            "base_url": replica.base_url,
            "api_key": "sk-sim",
            **({"metrics_url": replica.metrics_url} if metrics else {}),
        }
        for i, replica in enumerate(fleet.replicas)
    ]
    return {
        "models": [{"id": "sim", "routing": policy, "deployments": deployments, **model}],
        "router": {"retry_backoff_s": 0.001, "max_backoff_s": 0.01, **POLL},
    }


def turn_body(session: int, turn: int, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    messages.append({"role": "user", "content": f"session {session}: fix bug {session * 7}"})
    for t in range(turn):
        messages += [{"role": "assistant", "content": f"done step {t}"}, {"role": "user", "content": f"next {t}"}]
    return {"model": "sim", "messages": messages, "max_tokens": 4, **extra}


def served_by(fleet: ReplicaFleet, session: int) -> set[int]:
    """The replicas that served any turn of `session`."""
    marker = f"session {session}:"
    return {i for i, r in enumerate(fleet.replicas) for m in r.stats.first_messages if m.startswith(marker)}


async def chat(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    response = await client.post("/v1/chat/completions", json=body, headers={**AUTH, **headers})
    assert response.status_code == 200, response.text
    return response


async def wait_for_polls(app: Any, num_rounds: int = 2) -> None:
    poller = app.state.replica_metrics
    start = poller.num_rounds
    for _ in range(400):
        if poller.num_rounds >= start + num_rounds:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the replica metrics poller did not run")


async def test_prefix_affinity_keeps_each_conversation_on_one_replica(fleet: ReplicaFleet) -> None:
    async with asgi_client(build_app(routing(fleet, "prefix_affinity"))) as client:
        for turn in range(4):
            for session in range(8):
                response = await chat(client, turn_body(session, turn))
                if turn > 0:  # the replica that served the earlier turns has them cached
                    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert all(len(served_by(fleet, s)) == 1 for s in range(8))
    assert len({next(iter(served_by(fleet, s))) for s in range(8)}) >= 2  # the sessions spread


async def test_two_gateway_instances_agree_without_sharing_anything(fleet: ReplicaFleet) -> None:
    apps = [build_app(routing(fleet, "prefix_affinity")), build_app(routing(fleet, "prefix_affinity"))]
    async with asgi_client(apps[0]) as a, asgi_client(apps[1]) as b:
        for turn in range(4):
            for session in range(8):
                await chat((a, b)[(turn + session) % 2], turn_body(session, turn))
        # a named session: x-session-id, then the body's user / prompt_cache_key
        for turn in range(4):
            await chat((a, b)[turn % 2], turn_body(100 + turn, 0), **{"x-session-id": "agent-42"})
            await chat((a, b)[turn % 2], turn_body(200 + turn, 0, prompt_cache_key="cache-7"))
    assert all(len(served_by(fleet, s)) == 1 for s in range(8))
    assert len(set().union(*(served_by(fleet, 100 + t) for t in range(4)))) == 1
    assert len(set().union(*(served_by(fleet, 200 + t) for t in range(4)))) == 1


async def test_bounded_load_spills_a_hot_key_within_the_bound(fleet: ReplicaFleet) -> None:
    """16 requests of one session at once: none of the 4 replicas holds more than ceil(1.25 × 16 / 4) = 5."""
    app = build_app(routing(fleet, "prefix_affinity", metrics=False, affinity={"load_factor": 1.25, "load_slack": 0}))
    async with asgi_client(app) as client:
        body = turn_body(1, 0, max_tokens=40)
        await asyncio.gather(*(chat(client, body, **{"x-session-id": "hot"}) for _ in range(16)))
    assert sum(r.stats.num_requests for r in fleet.replicas) == 16
    assert max(r.stats.peak_load for r in fleet.replicas) <= 5
    assert sum(1 for r in fleet.replicas if r.stats.num_requests) >= 2


async def test_least_load_follows_what_the_replicas_report(fleet: ReplicaFleet) -> None:
    for replica in fleet.replicas[:3]:
        replica.extra_waiting = 50  # another gateway's traffic, as far as this one can tell
    app = build_app(routing(fleet, "least_load"))
    async with asgi_client(app) as client:
        await wait_for_polls(app)
        for session in range(8):
            await chat(client, turn_body(session, 0))
    assert [r.stats.num_requests for r in fleet.replicas] == [0, 0, 0, 8]


async def test_missing_load_signals_fall_back_to_in_flight_counts(fleet: ReplicaFleet) -> None:
    for replica in fleet.replicas:
        replica.extra_waiting = 50
        replica.metrics_mode = "empty"  # answers, but without the load metrics
    fleet.replicas[3].extra_waiting = 0
    app = build_app(routing(fleet, "least_load"))
    async with asgi_client(app) as client:
        await wait_for_polls(app)
        for session in range(24):
            await chat(client, turn_body(session, 0))
    # in-flight counts: every idle replica ties, so the reports (which would send all to r3) play no part
    assert sum(1 for r in fleet.replicas if r.stats.num_requests) >= 3


@pytest.mark.parametrize("policy", ["least_load", "prefix_affinity"])
async def test_a_replica_whose_metrics_stop_answering_gets_no_new_requests(fleet: ReplicaFleet, policy: str) -> None:
    fleet.replicas[1].metrics_mode = "down"
    fleet.replicas[2].metrics_mode = "hang"
    app = build_app(routing(fleet, policy))
    async with asgi_client(app) as client:
        await wait_for_polls(app, 3)
        for session in range(16):
            await chat(client, turn_body(session, 0))
        assert fleet.replicas[1].stats.num_requests == fleet.replicas[2].stats.num_requests == 0
        fleet.replicas[1].metrics_mode = "ok"
        await wait_for_polls(app)
        for session in range(16, 48):
            await chat(client, turn_body(session, 0))
    assert fleet.replicas[1].stats.num_requests > 0
    assert fleet.replicas[2].stats.num_requests == 0


async def test_a_dead_replica_is_avoided(fleet: ReplicaFleet) -> None:
    app = build_app(routing(fleet, "prefix_affinity"))
    async with asgi_client(app) as client:
        await chat(client, turn_body(0, 0))
        home = next(iter(served_by(fleet, 0)))
        fleet.kill(home)
        for turn in range(1, 4):  # its conversation moves (a retry at first, then the poller's verdict)
            await chat(client, turn_body(0, turn))
        await wait_for_polls(app)
        for session in range(1, 17):
            await chat(client, turn_body(session, 0))
    assert fleet.replicas[home].stats.num_requests == 1
    assert len(served_by(fleet, 0) - {home}) == 1


async def test_round_robin_takes_turns(fleet: ReplicaFleet) -> None:
    async with asgi_client(build_app(routing(fleet, "round_robin", metrics=False))) as client:
        for session in range(8):
            await chat(client, turn_body(session, 0))
    assert [r.stats.num_requests for r in fleet.replicas] == [2, 2, 2, 2]
