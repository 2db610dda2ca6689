"""`TeamStore` and the team side of `KeyStore`: records, listing, membership kept in step with key records,
delete with and without force, usage under the team's own names."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from auth import redis_names
from auth.store import KeyStore
from auth.teams import TeamStore, is_team_id
from gateway.errors import InvalidRequestError, NotFoundError


@pytest.fixture
def teams(redis: Redis) -> TeamStore:
    return TeamStore(redis)


async def test_create_get_update_list(teams: TeamStore) -> None:
    team = await teams.create(name="research", rpm=3, budget_micros=1_000_000, weight=2.0, priority="high")
    assert is_team_id(team.id) and team.version == 1 and team.num_keys == 0
    fetched = await teams.get(team.id)
    assert (fetched.name, fetched.rpm, fetched.budget_micros, fetched.weight, fetched.priority) == (
        "research",
        3,
        1_000_000,
        2.0,
        "high",
    )
    updated = await teams.update(team.id, {"rpm": None, "tpm": 100, "models": ["a/*"]})
    assert (updated.rpm, updated.tpm, updated.models, updated.version) == (None, 100, ("a/*",), 2)
    others = [await teams.create(name=f"t{i}") for i in range(3)]
    page, cursor = await teams.list(limit=2)
    assert [t.id for t in page] == [team.id, others[0].id] and cursor == others[0].id
    page, cursor = await teams.list(limit=2, cursor=cursor)
    assert [t.id for t in page] == [others[1].id, others[2].id] and cursor is None


async def test_refusals(teams: TeamStore) -> None:
    with pytest.raises(NotFoundError) as missing:
        await teams.get("team_0000000000000000")
    assert missing.value.code == "team_not_found"
    with pytest.raises(NotFoundError):
        await teams.update("team_0000000000000000", {"rpm": 1})
    for bad in ({"weight": 0}, {"priority": "urgent"}, {"budget_period": "week"}, {"rpm": -1}):
        with pytest.raises(InvalidRequestError):
            await teams.create(name="x", **bad)  # type: ignore[arg-type]
    team = await teams.create(name="x")
    for changes in ({"colour": "red"}, {"name": None}, {"max_concurrent": 0}):
        with pytest.raises(InvalidRequestError):
            await teams.update(team.id, changes)


async def test_membership_follows_the_key_record(teams: TeamStore, store: KeyStore) -> None:
    a, b = await teams.create(name="a"), await teams.create(name="b")
    key, _ = await store.create({"name": "k"}, team_id=a.id)
    other, _ = await store.create({"name": "o", "team_id": a.id})
    assert key.team_id == a.id and await teams.members(a.id) == sorted([key.id, other.id])
    assert (await teams.get(a.id)).num_keys == 2
    moved = await store.update(key.id, {"team_id": b.id})
    assert moved.team_id == b.id
    assert await teams.members(a.id) == [other.id] and await teams.members(b.id) == [key.id]
    await store.update(key.id, {"team_id": None})
    assert (await store.get(key.id)).team_id is None and await teams.members(b.id) == []
    with pytest.raises(NotFoundError) as missing:
        await store.update(key.id, {"team_id": "team_0000000000000000"})
    assert missing.value.code == "team_not_found"
    with pytest.raises(NotFoundError):
        await store.create({}, team_id="team_0000000000000000")


async def test_a_stale_member_is_dropped(teams: TeamStore, store: KeyStore, redis: Redis) -> None:
    """A move that failed between the set and the record leaves a member whose record names no team: readers
    drop it, and it does not keep the team from being deleted."""
    team = await teams.create(name="t")
    key, _ = await store.create({})
    await redis.sadd(redis_names.team_members(team.id), key.id)  # type: ignore[misc]
    assert await teams.members(team.id) == []
    await teams.delete(team.id)


async def test_delete_refuses_a_team_with_keys_unless_forced(teams: TeamStore, store: KeyStore, redis: Redis) -> None:
    team = await teams.create(name="t", rpm=5)
    key, _ = await store.create({"name": "k", "rpm": 7}, team_id=team.id)
    with pytest.raises(InvalidRequestError) as refused:
        await teams.delete(team.id)
    assert refused.value.code == "team_has_keys"
    await redis.hset(redis_names.key_usage_day(redis_names.team_state_id(team.id), "2026-01-01"), "m|requests", 1)
    await teams.delete(team.id, force=True)
    detached = await store.get(key.id)
    assert detached.team_id is None and detached.rpm == 7
    with pytest.raises(NotFoundError):
        await teams.get(team.id)
    assert await teams.list() == ([], None)
    assert not await redis.exists(redis_names.team_members(team.id), redis_names.team_record(team.id))


async def test_weight_and_priority_on_keys(store: KeyStore) -> None:
    key, _ = await store.create({"weight": 3.0, "priority": "low"})
    assert (key.weight, key.priority) == (3.0, "low")
    updated = await store.update(key.id, {"priority": "high"})
    assert (updated.weight, updated.priority) == (3.0, "high")
    assert ((await store.create({}))[0].weight, (await store.create({}))[0].priority) == (1.0, "normal")
