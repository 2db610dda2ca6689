"""prefix_affinity's moves shared between two gateway instances through a real Redis (gateway/placement_sync.py):
a move one router makes reaches the other's placements, and the other then routes the key there; an instance
ignores its own messages and anything it does not understand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from auth import redis_names
from auth.redis_client import RedisClient, connect
from gateway.placement_sync import PlacementSync
from gateway.router import Router
from gateway.routing_config import parse_routing
from gateway.routing_policies import MAX_PLACEMENTS, request_key

ROUTING = {
    "models": [
        {
            "id": "m",
            "routing": "prefix_affinity",
            "deployments": [
                {"type": "openai", "name": name, "base_url": f"http://{name}.invalid/v1", "api_key": "sk"}
                for name in ("a", "b", "c")
            ],
        },
        {"id": "plain", "deployments": [{"type": "openai", "base_url": "http://p.invalid/v1", "api_key": "sk"}]},
    ]
}
BODY = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]}


def router() -> Router:
    config = parse_routing(ROUTING, source="test")
    return Router(config, {d.name: None for m in config.models for d in m.deployments})  # type: ignore[misc]


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[RedisClient]:
    client = connect(redis_url)
    yield client
    await client.aclose()


async def eventually(check: object, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in time")


async def subscribed(redis: RedisClient, count: int) -> None:
    for _ in range(2000):
        numsub = await redis.pubsub_numsub(redis_names.PLACEMENTS_CHANNEL)
        if numsub and numsub[0][1] >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the instances did not subscribe")


async def test_a_move_on_one_instance_reaches_the_other(redis: RedisClient) -> None:
    first, second = router(), router()
    syncs = [PlacementSync(redis, r, max_placements=MAX_PLACEMENTS) for r in (first, second)]
    assert all(s.is_needed for s in syncs)
    for sync in syncs:
        sync.start()
    try:
        await subscribed(redis, 2)
        route_a, route_b = first.find("m").route, second.find("m").route  # type: ignore[union-attr]
        assert route_b.on_move is not None and first.find("plain").route.on_move is None  # type: ignore[union-attr]
        key = request_key(route_a.config, BODY, None)
        assert key is not None
        # The key's first choice on both (no load anywhere): the same deployment.
        choice = first.pick(route_a, key=key)
        assert choice is not None and second.pick(route_b, key=key) is not None
        assert route_b.placements[key] == choice.name
        moved_to = next(d.name for d in route_a.deployments if d.name != choice.name)
        route_a.placements[key] = moved_to  # what a spill does on the first instance ...
        route_a.on_move(route_a, key, moved_to)  # type: ignore[misc]  # ... and tells the others
        await eventually(lambda: route_b.placements.get(key) == moved_to)
        picked = second.pick(route_b, key=key)
        assert picked is not None and picked.name == moved_to  # the next turn through the other follows it
        assert syncs[0].num_applied == 0  # its own message came back and was skipped
        assert syncs[1].num_applied == 1 and syncs[0].num_published == 1
    finally:
        for sync in syncs:
            await sync.aclose()


def test_what_is_not_understood_is_skipped() -> None:
    mine = router()
    sync = PlacementSync(None, mine, max_placements=2)  # type: ignore[arg-type]  # apply() does not touch Redis
    route = mine.find("m").route  # type: ignore[union-attr]
    key = b"\x01" * 16
    for data in (
        b"not json",
        orjson.dumps({"x": 1}),
        orjson.dumps(["other", "not a list"]),
        orjson.dumps(["other", [["m", key.hex(), "nowhere"]]]),  # no such deployment
        orjson.dumps(["other", [["plain", key.hex(), "plain#0"]]]),  # not a prefix_affinity model
        orjson.dumps(["other", [["m", "zz", "a"]]]),  # not hex
        orjson.dumps(["other", [["m", key.hex()]]]),  # short
    ):
        sync.apply(data)
    assert route.placements == {} and sync.num_applied == 0
    moves = [["m", bytes([n]).hex() * 16, "b"] for n in range(3)]
    sync.apply(orjson.dumps(["other", moves]))
    assert list(route.placements.values()) == ["b", "b"] and len(route.placements) == 2  # the cap: oldest went
