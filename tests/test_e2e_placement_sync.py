"""Two production gateways on one Redis in front of a simulated fleet, `routing: prefix_affinity`: a conversation
that load pushed off its replica on one gateway follows its prefix to the new replica when its next turn goes
through the other gateway (gateway/placement_sync.py), instead of going back to its first choice."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import AUTH
from fakes.instances import gateway_instances
from fakes.replica_sim import ReplicaFleet, SimParams

from gateway.prefix_hash import affinity_key
from gateway.routing_policies import Candidate, rendezvous_order

NAMES = ["r0", "r1", "r2", "r3"]
AFFINITY = {"load_factor": 1.0, "load_slack": 0}  # an idle fleet of 4 allows 1 request per replica: a 2nd spills


@pytest.fixture
def fleet() -> Iterator[ReplicaFleet]:
    with ReplicaFleet(4, SimParams(time_scale=0.2, default_max_tokens=4)) as fleet:
        yield fleet


def order(session: str) -> list[str]:
    key = affinity_key({}, session, block_chars=256, max_blocks=64)
    return [c.name for c in rendezvous_order(key, [Candidate(n, 1.0, 0.0) for n in NAMES])]


def body(session: str, turn: int, max_tokens: int = 4) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"{session}: turn 0"}]
    for t in range(1, turn + 1):
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"{session}: turn {t}"}]
    return {"model": "sim", "messages": messages, "max_tokens": max_tokens}


def served(fleet: ReplicaFleet, session: str) -> list[str]:
    return [NAMES[i] for i, r in enumerate(fleet.replicas) for m in r.stats.first_messages if m.startswith(session)]


async def test_a_moved_conversation_is_followed_through_the_other_gateway(
    redis_url: str, tmp_path: Path, fleet: ReplicaFleet
) -> None:
    # Two sessions whose first choice is the same replica.
    hot = "session-hot"
    first = order(hot)[0]
    moved = next(s for s in (f"session-{n}" for n in itertools.count()) if s != hot and order(s)[0] == first)
    deployments = [
        {"type": "openai", "name": name, "base_url": replica.base_url, "api_key": "sk-sim"}
        for name, replica in zip(NAMES, fleet.replicas, strict=True)
    ]
    models = [{"id": "sim", "routing": "prefix_affinity", "deployments": deployments, "affinity": AFFINITY}]
    router = {"retry_backoff_s": 0.001, "max_backoff_s": 0.01}
    with gateway_instances(redis_url, tmp_path, models, router=router) as (a, b):
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:

            async def chat(server: Any, session: str, turn: int, max_tokens: int = 4) -> None:
                response = await client.post(
                    f"{server.url}/v1/chat/completions",
                    json=body(session, turn, max_tokens),
                    headers={"x-session-id": session},
                )
                assert response.status_code == 200, response.text

            # A long request of `hot` holds its replica on gateway a ...
            long_one = asyncio.create_task(chat(a, hot, 0, max_tokens=1000))
            for _ in range(2000):
                if served(fleet, hot):
                    break
                await asyncio.sleep(0.01)
            assert served(fleet, hot) == [first]
            # ... so `moved`'s first turn, also through a, spills off that replica to its second choice.
            await chat(a, moved, 0)
            spilled_to = served(fleet, moved)
            assert spilled_to == [order(moved)[1]] and spilled_to[0] != first
            # Its next turns go through b, where nothing holds `first`: they follow the conversation to where its
            # prefix is (b heard of a's move) rather than going to its first choice.
            for turn in range(1, 4):
                for _ in range(500):  # b hears of the move within milliseconds; a turn comes seconds later
                    if await placement_known(b, moved):
                        break
                    await asyncio.sleep(0.01)
                await chat(b, moved, turn)
            assert served(fleet, moved) == spilled_to * 4
            await long_one


async def placement_known(server: Any, session: str) -> bool:
    """Whether `server`'s router holds a placement for `session` (read in its own process)."""
    router = server.server.config.app.state.router
    route = router.find("sim").route
    key = affinity_key({}, session, block_chars=256, max_blocks=64)
    return key in route.placements
