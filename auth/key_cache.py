"""The keys this instance has verified, by key hash: what `admit` sends the script (the key's id and record version,
so a known key costs no GET; its team and the team record's version, so a key in a team is admitted with its team
in one round trip) and what `authenticate` and a Redis outage are served from.

An entry is fresh for `ttl_s` after Redis last verified it. An admin's change to a key is published on
`ug:events` (auth/store.py) with the key's id, a change to a team (auth/teams.py) with the team's id; the listener
drops the entries of that key, or of every key of that team, at once, and after any gap in its subscription drops
them all (events may have been missed). Versions cover a missed event too: the scripts return a record whose
version differs from the one sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import orjson

from auth import redis_names
from auth.base import Principal, Priority
from auth.redis_client import RedisClient, listen
from auth.rejections import expired_error, revoked_error
from auth.store import KeyRecord
from auth.upstream import cancel_until_done

__all__ = ["CachedKey", "CachedTeam", "KeyCache"]

_MAX_CACHED_KEYS = 10_000


def _priority(value: str | None) -> Priority:
    return "high" if value == "high" else "low" if value == "low" else "normal"


def _reads_its_settles(*limits: int | None) -> bool:
    """A budget or a TPM limit: the next admission (on any instance) reads what the settles write."""
    return any(limit is not None and limit >= 0 for limit in limits)


@dataclass(frozen=True, slots=True)
class CachedTeam:
    """What admission and the principal need of a key's team record."""

    team_id: str
    version: int
    name: str
    models: tuple[str, ...]
    weight: float
    priority: Priority
    reads_its_settles: bool

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> CachedTeam:
        def limit(name: str) -> int | None:
            return int(raw[name]) if raw.get(name) else None

        return cls(
            team_id=raw["id"],
            version=int(raw.get("version") or 0),
            name=raw.get("name", ""),
            models=tuple(orjson.loads(raw.get("models") or "[]")),
            weight=float(raw.get("weight") or 1.0),
            priority=_priority(raw.get("priority")),
            reads_its_settles=_reads_its_settles(limit("tpm"), limit("token_budget"), limit("budget_micros")),
        )


@dataclass(slots=True)
class CachedKey:
    key_id: str
    version: int
    principal: Principal
    expires_at_ms: int | None
    is_revoked: bool
    verified_at: float  # monotonic time of the last verification against Redis
    # A budget or a TPM limit: the next admission (on any instance) reads what this key's settles write.
    reads_its_settles: bool = False
    team_id: str | None = None  # the team the key's record names
    team: CachedTeam | None = None  # that team's record, once an admission has returned it
    own: Principal | None = None  # the principal from the key's record alone (`principal` adds the team's)

    def set_team(self, team: CachedTeam | None) -> None:
        """The key's team record as an admission returned it (None: the team is gone); the principal follows."""
        self.team = team
        own = self.own or self.principal
        if team is None:
            self.principal = own
        else:
            self.principal = replace(
                own, team_models=team.models, team_name=team.name, weight=team.weight, priority=team.priority
            )

    def check(self) -> None:
        """Raise if the cached record itself says no (used when Redis cannot be asked)."""
        if self.is_revoked:
            raise revoked_error()
        if self.expires_at_ms is not None and self.expires_at_ms <= time.time() * 1000:
            raise expired_error()


class KeyCache:
    """Verified keys by hash, at most `_MAX_CACHED_KEYS` (the oldest goes first). `start()` listens for key
    changes, `aclose()` stops listening."""

    def __init__(self, redis: RedisClient, *, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._entries: dict[str, CachedKey] = {}
        self._listener: asyncio.Task[None] | None = None
        self._is_closing = False

    def get(self, key_hash: str) -> CachedKey | None:
        return self._entries.get(key_hash)

    def is_fresh(self, cached: CachedKey | None) -> bool:
        """Verified against Redis less than `ttl_s` ago (False for no entry)."""
        return cached is not None and time.monotonic() - cached.verified_at < self._ttl_s

    def remember(self, key_hash: str, record: KeyRecord) -> CachedKey:
        """Cache `record` as verified now (replacing what was cached under `key_hash`)."""
        own = Principal(
            key_id=record.id,
            name=record.name,
            models=record.models,
            team_id=record.team_id,
            weight=record.weight,
            priority=_priority(record.priority),
        )
        cached = CachedKey(
            key_id=record.id,
            version=record.version,
            principal=own,
            expires_at_ms=record.expires_at_ms,
            is_revoked=record.is_revoked,
            verified_at=time.monotonic(),
            reads_its_settles=_reads_its_settles(record.tpm, record.token_budget, record.budget_micros),
            team_id=record.team_id,
            own=own,
        )
        old = self._entries.pop(key_hash, None)
        if old is not None and old.team is not None and old.team_id == record.team_id:
            cached.set_team(old.team)  # the team's record did not change with the key's
        if len(self._entries) >= _MAX_CACHED_KEYS:
            del self._entries[next(iter(self._entries))]
        self._entries[key_hash] = cached
        return cached

    def forget(self, key_hash: str) -> None:
        """Drop a hash Redis no longer knows (a rotated or deleted key)."""
        self._entries.pop(key_hash, None)

    def invalidate(self, changed_id: str) -> None:
        """Drop every entry of a key that changed, or of every key of a team that changed."""
        for key_hash in [h for h, c in self._entries.items() if changed_id in (c.key_id, c.team_id)]:
            del self._entries[key_hash]

    def start(self) -> None:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="unigate-key-events")

    async def aclose(self) -> None:
        self._is_closing = True  # the listener also checks it at least once a second
        if self._listener is not None:
            await cancel_until_done({self._listener}, timeout_s=3.0)
        self._listener = None

    async def _listen(self) -> None:
        """Drop cached keys on `ug:events`; after any gap in the subscription drop them all (events were missed)."""
        await listen(
            self._redis,
            redis_names.EVENTS_CHANNEL,
            lambda data: self.invalidate(data.decode()),
            is_closing=lambda: self._is_closing,
            on_resubscribed=self._entries.clear,
        )
