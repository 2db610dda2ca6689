"""`KeyCache`: verified keys by hash, bounded, fresh for their TTL, dropped when an admin changes the key."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from auth import key_cache, redis_names
from auth.key_cache import KeyCache
from auth.redis_client import connect
from auth.store import KeyRecord
from gateway.errors import AuthError


def record(key_id: str, **fields: str) -> KeyRecord:
    return KeyRecord.from_hash({"id": key_id, "name": f"name-{key_id}", "version": "3", **fields})


def idle_cache(ttl_s: float = 60.0) -> KeyCache:
    return KeyCache(connect("redis://127.0.0.1:1/0"), ttl_s=ttl_s)  # never started: no connection is made


def test_a_remembered_key_is_fresh_for_its_ttl() -> None:
    cache = idle_cache()
    cached = cache.remember("h1", record("k1", models='["m"]'))
    assert cache.get("h1") is cached and cache.get("h2") is None
    assert (cached.key_id, cached.version, cached.principal.models) == ("k1", 3, ("m",))
    assert cache.is_fresh(cached) and not cache.is_fresh(None)
    cached.verified_at = time.monotonic() - 61
    assert not cache.is_fresh(cached)
    assert not idle_cache(ttl_s=0).is_fresh(cached)


def test_invalidate_drops_every_hash_of_the_key_and_forget_one_hash() -> None:
    cache = idle_cache()
    cache.remember("old", record("k1"))
    cache.remember("new", record("k1"))
    cache.remember("other", record("k2"))
    cache.invalidate("k1")
    assert cache.get("old") is None and cache.get("new") is None and cache.get("other") is not None
    cache.forget("other")
    assert cache.get("other") is None


def test_the_cache_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(key_cache, "_MAX_CACHED_KEYS", 2)
    cache = idle_cache()
    for key_hash in ("a", "b", "c"):
        cache.remember(key_hash, record(key_hash))
    assert [cache.get(h) is not None for h in ("a", "b", "c")] == [False, True, True]
    cache.remember("b", record("b"))  # re-verified: now the newest
    cache.remember("d", record("d"))
    assert [cache.get(h) is not None for h in ("b", "c", "d")] == [True, False, True]


@pytest.mark.parametrize(
    ("fields", "reads_its_settles"),
    [({}, False), ({"rpm": "5", "max_concurrent": "2"}, False), ({"tpm": "0"}, True), ({"token_budget": "9"}, True),
     ({"budget_micros": "1"}, True)],
)  # fmt: skip
def test_a_key_with_a_budget_or_tpm_reads_its_settles(fields: dict[str, str], reads_its_settles: bool) -> None:
    assert idle_cache().remember("h", record("k", **fields)).reads_its_settles is reads_its_settles


def test_the_cached_record_says_no_for_a_revoked_or_expired_key() -> None:
    cache = idle_cache()
    with pytest.raises(AuthError, match="revoked"):
        cache.remember("r", record("r", revoked="1")).check()
    with pytest.raises(AuthError, match="expired"):
        cache.remember("e", record("e", expires_at=str(int(time.time() * 1000) - 1))).check()
    cache.remember("ok", record("ok", expires_at=str(int(time.time() * 1000) + 60_000))).check()


async def test_a_published_key_change_drops_the_key(redis_url: str) -> None:
    client: Any = connect(redis_url)
    cache = KeyCache(client, ttl_s=60.0)
    cache.remember("h", record("k1"))
    cache.start()
    try:
        for _ in range(200):  # until the listener has subscribed and the event reached it
            await client.publish(redis_names.EVENTS_CHANNEL, "k1")
            if cache.get("h") is None:
                break
            await asyncio.sleep(0.02)
        assert cache.get("h") is None
    finally:
        await cache.aclose()
        await client.aclose()


def test_a_team_change_drops_its_keys_and_the_team_sets_the_principal() -> None:
    cache = idle_cache()
    member = cache.remember("m", record("k1", team_id="team_a", weight="0.5", priority="low"))
    cache.remember("o", record("k2"))
    assert (member.principal.team_id, member.principal.weight, member.principal.priority) == ("team_a", 0.5, "low")
    team = key_cache.CachedTeam.from_hash(
        {"id": "team_a", "version": "2", "name": "ops", "models": '["x/*"]', "weight": "4", "priority": "high"}
    )
    member.set_team(team)
    principal = member.principal
    assert (principal.weight, principal.priority, principal.team_name, principal.tenant) == (
        4.0,
        "high",
        "ops",
        "team_a",
    )
    assert principal.may_use("x/y") and not principal.may_use("z")
    assert cache.remember("m", record("k1", team_id="team_a")).team is team  # a key change keeps its team's record
    cache.invalidate("team_a")
    assert cache.get("m") is None and cache.get("o") is not None
