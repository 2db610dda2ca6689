"""A key and its team admitted in one decision, through the real `RedisAccess` on a real Redis: the team's limits
are shared by its keys, a refusal names the team, and a refusal by either side leaves the other uncharged."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio import Redis

from auth import redis_names
from auth.access import RedisAccess
from auth.base import Admission, BudgetCost, SettleUsage
from auth.resp_pipe import CommandPipe
from auth.store import KeyStore
from auth.teams import TeamStore
from gateway.errors import GatewayError

COST = 800_000  # $0.80 in micro-units


@pytest.fixture
def teams(redis: Redis) -> TeamStore:
    return TeamStore(redis)


async def _num_logged(redis: Redis, state_id: str) -> int:
    return int(await redis.zcard(redis_names.key_rpm_log(state_id)))


async def test_a_team_rpm_is_shared_by_its_keys_and_its_refusal_names_the_team(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    team = await teams.create(name="research", rpm=3)
    a, a_secret = await store.create({"rpm": 10}, team_id=team.id)
    b, b_secret = await store.create({"rpm": 10}, team_id=team.id)
    access: RedisAccess = await make_access()
    for secret in (a_secret, b_secret, a_secret):  # the first of each key learns its team; the third is pipelined
        admission = await access.admit(secret, model="m", estimated_tokens=1)
        assert admission.team_id == team.id and admission.principal.team_id == team.id
    with pytest.raises(GatewayError) as refused:
        await access.admit(b_secret, model="m", estimated_tokens=1)
    assert refused.value.status_code == 429 and refused.value.code == "rate_limit_exceeded"
    assert "team 'research' rpm limit of 3" in refused.value.message
    # The team refused: key b's own admission of that request was cancelled.
    assert await _num_logged(redis, a.id) == 2 and await _num_logged(redis, b.id) == 1
    assert await _num_logged(redis, redis_names.team_state_id(team.id)) == 3


async def test_a_refusal_by_the_key_leaves_the_team_uncharged(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    team = await teams.create(name="t", rpm=10, tpm=1000, max_concurrent=5, budget_micros=10 * COST)
    _, secret = await store.create({"rpm": 1}, team_id=team.id)
    access: RedisAccess = await make_access()
    budget = BudgetCost(tokens=50, costs=(("m", COST),))
    first = await access.admit(secret, model="m", estimated_tokens=40, budget=budget)
    with pytest.raises(GatewayError) as refused:
        await access.admit(secret, model="m", estimated_tokens=40, budget=budget)  # pipelined with the team's
    assert refused.value.code == "rate_limit_exceeded" and "this API key" in refused.value.message
    state = redis_names.team_state_id(team.id)
    assert await _num_logged(redis, state) == 1
    assert int(await redis.get(redis_names.key_tpm_sum(state)) or 0) == 40
    assert await redis.zcard(redis_names.key_leases(state)) == 1
    assert await redis.zcard(redis_names.key_holds(state)) == 1
    await access.settle(first, SettleUsage(10, 20, cost_micros=COST, is_priced=True))
    assert (
        await redis.zcard(redis_names.key_leases(state)) == 0 and await redis.zcard(redis_names.key_holds(state)) == 0
    )
    assert int(await redis.get(redis_names.key_tpm_sum(state)) or 0) == 30
    record = await teams.get(team.id)
    assert (record.num_requests, record.prompt_tokens, record.completion_tokens, record.spend_micros) == (
        1,
        10,
        20,
        COST,
    )
    [row] = await teams.usage(team.id)
    assert (row.model, row.num_requests, row.cost_micros) == ("m", 1, COST)


async def test_the_team_allowlist_is_intersected_with_the_key(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    team = await teams.create(name="vision", models=["img/*"])
    _, secret = await store.create({"models": ["img/*", "text/*"]}, team_id=team.id)
    access: RedisAccess = await make_access()
    admission = await access.admit(secret, model="img/a", estimated_tokens=1)
    assert admission.principal.may_use("img/b") and not admission.principal.may_use("text/a")
    with pytest.raises(GatewayError) as refused:
        await access.admit(secret, model="text/a", estimated_tokens=1)
    assert refused.value.code == "model_not_allowed" and "team 'vision'" in refused.value.message


async def test_a_team_budget_is_hard_by_reservation_across_two_instances(
    make_access: Any, teams: TeamStore, store: KeyStore
) -> None:
    """20 concurrent $0.80 requests over two keys of a $1 team, through two gateway instances: one is admitted at a
    time, so the team never spends more than $1.60 (one request admitted under the budget, one over it at most)."""
    team = await teams.create(name="t", budget_micros=1_000_000)
    secrets = [(await store.create({}, team_id=team.id))[1] for _ in range(2)]
    instances: list[RedisAccess] = [await make_access(), await make_access()]
    for access, secret in zip(instances, secrets, strict=True):  # teach each instance its key's team
        await access.settle(await access.admit(secret, model="m", estimated_tokens=1), SettleUsage(0, 0))
    budget = BudgetCost(tokens=100, costs=(("m", COST),))

    async def one(i: int) -> Admission | None:
        access = instances[i % 2]
        try:
            admission = await access.admit(secrets[i % 2], model="m", estimated_tokens=10, budget=budget)
        except GatewayError as error:
            assert error.code == "budget_exceeded" and "team 't'" in error.message, error.message
            return None
        await asyncio.sleep(0.01)
        await access.settle(admission, SettleUsage(10, 90, cost_micros=COST, is_priced=True))
        return admission

    admitted = [a for a in await asyncio.gather(*(one(i) for i in range(20))) if a is not None]
    assert len(admitted) == 1
    assert (await teams.get(team.id)).spend_micros <= 1_600_000


async def test_a_key_moved_to_another_team_is_charged_there(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    """The instance guessed the old team (cached); the key's record names the new one: the guess is cancelled and
    the request charged to the new team only, whether or not the change event arrived first."""
    old, new = await teams.create(name="old", rpm=5), await teams.create(name="new", rpm=5)
    key, secret = await store.create({}, team_id=old.id)
    access: RedisAccess = await make_access()
    await access.admit(secret, model="m", estimated_tokens=1)
    await store.update(key.id, {"team_id": new.id})
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    assert admission.team_id == new.id
    assert await _num_logged(redis, redis_names.team_state_id(old.id)) == 1
    assert await _num_logged(redis, redis_names.team_state_id(new.id)) == 1
    await store.update(key.id, {"team_id": None})
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    assert admission.team_id is None and admission.principal.team_id is None
    assert await _num_logged(redis, redis_names.team_state_id(new.id)) == 1


async def test_weight_and_priority_come_from_the_team(make_access: Any, teams: TeamStore, store: KeyStore) -> None:
    team = await teams.create(name="t", weight=3.0, priority="high")
    _, in_team = await store.create({"weight": 0.5, "priority": "low"}, team_id=team.id)
    _, alone = await store.create({"weight": 2.0, "priority": "low"})
    access: RedisAccess = await make_access()
    principal = (await access.admit(in_team, model="m", estimated_tokens=1)).principal
    assert (principal.weight, principal.priority, principal.tenant) == (3.0, "high", team.id)
    principal = (await access.admit(alone, model="m", estimated_tokens=1)).principal
    assert (principal.weight, principal.priority, principal.tenant) == (2.0, "low", principal.key_id)
    await teams.update(team.id, {"weight": 5.0})
    for _ in range(100):  # the change event reaches the cache
        principal = (await access.admit(in_team, model="m", estimated_tokens=1)).principal
        if principal.weight == 5.0:
            break
        await asyncio.sleep(0.02)
    assert principal.weight == 5.0


async def test_a_deleted_team_leaves_its_keys_with_their_own_limits(
    make_access: Any, teams: TeamStore, store: KeyStore
) -> None:
    team = await teams.create(name="t", rpm=0)
    key, secret = await store.create({}, team_id=team.id)
    access: RedisAccess = await make_access()
    with pytest.raises(GatewayError):
        await access.admit(secret, model="m", estimated_tokens=1)
    await teams.delete(team.id, force=True)
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    assert admission.team_id is None
    assert (await store.get(key.id)).team_id is None


async def test_a_request_in_flight_when_its_team_is_deleted_settles_on_the_key_only(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    team = await teams.create(name="t", rpm=5)
    key, secret = await store.create({}, team_id=team.id)
    access: RedisAccess = await make_access()
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    assert admission.team_id == team.id
    await teams.delete(team.id, force=True)
    await access.settle(admission, SettleUsage(3, 4))
    assert (await store.get(key.id)).num_requests == 1
    state = redis_names.team_state_id(team.id)
    assert not await redis.exists(redis_names.team_record(team.id), redis_names.key_usage_total(state))


async def test_one_round_trip_with_or_without_a_team(make_access: Any, teams: TeamStore, store: KeyStore) -> None:
    """Once the key (and its team) are cached: a key without a team is admitted in one write to Redis, a key in a
    team too (its two admissions share the write)."""
    access: RedisAccess = await make_access()
    pipe = access._pipe
    if not isinstance(pipe, CommandPipe):
        pytest.skip("a cluster's pipe writes to each node on its own")
    team = await teams.create(name="t", rpm=100)
    _, alone = await store.create({"rpm": 100})
    _, in_team = await store.create({"rpm": 100}, team_id=team.id)
    for secret in (alone, in_team):
        await access.admit(secret, model="m", estimated_tokens=1)  # learn the key and its team
    connection = pipe._connection
    send = connection.send_packed_command
    writes: list[bytes] = []

    async def counting(data: Any, check_health: bool = True) -> None:
        writes.append(bytes(data))
        await send(data, check_health=check_health)

    connection.send_packed_command = counting  # type: ignore[method-assign]
    for secret, num_scripts in ((alone, 1), (in_team, 2)):
        writes.clear()
        await access.admit(secret, model="m", estimated_tokens=1)
        assert len(writes) == 1 and writes[0].count(b"EVALSHA") == num_scripts


async def test_the_pipelined_pair_registers_its_script_again_after_a_flush(
    make_access: Any, teams: TeamStore, store: KeyStore, redis: Redis
) -> None:
    team = await teams.create(name="t", rpm=5)
    _, secret = await store.create({}, team_id=team.id)
    access: RedisAccess = await make_access()
    await access.admit(secret, model="m", estimated_tokens=1)
    await redis.script_flush()  # as after a Redis restart that did not keep its scripts
    admission = await access.admit(secret, model="m", estimated_tokens=1)
    assert admission.team_id == team.id
    assert await _num_logged(redis, redis_names.team_state_id(team.id)) == 2
    assert access.num_script_errors == {} and access.num_storage_errors == 0


async def test_authenticate_knows_the_team_before_any_admission(
    make_access: Any, teams: TeamStore, store: KeyStore
) -> None:
    """What `/v1/models` lists for a key in a team: the models both allow."""
    team = await teams.create(name="t", models=["a/*"], weight=2.0)
    _, secret = await store.create({}, team_id=team.id)
    principal = await (await make_access()).authenticate(secret)
    assert principal.may_use("a/x") and not principal.may_use("b/x") and principal.weight == 2.0
