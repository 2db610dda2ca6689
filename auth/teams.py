"""`TeamStore`: team records in Redis — create, read, list, update, delete — their members and their usage.

A team is one hash (`redis_names.team_record`) with the same limit, budget and counter fields as a key record,
plus `weight` and `priority` (its share of the local engine); its own state (rate logs, leases, budget holds,
usage) is named like a key's under the state id `team:<id>`. A key's record names its team (`team_id`, set by
`KeyStore.create` / `KeyStore.update`); the team's member set follows it (see `KeyStore._join_team` for the
write order). Every change bumps the record's version and is announced on `ug:events` with the team's id, so
every instance drops its cached principals of the team's keys.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from auth import redis_names, scripts
from auth.keys import is_team_id, new_team_id
from auth.redis_client import RedisClient, is_cluster
from auth.scripts import DEFAULT_SCRIPTS, ScriptSet, as_text, storage_errors
from auth.store import BudgetCounters, KeyStore, UsageRow, UsageTotals, encode_fields, index_page, team_not_found
from gateway.errors import InvalidRequestError

__all__ = ["TeamRecord", "TeamStore", "is_team_id"]

_PRIORITIES = ("high", "normal", "low")
_PERIODS = ("total", "day", "month")
_LIMITS = ("rpm", "tpm", "max_concurrent", "token_budget", "budget_micros")
_SETTABLE = frozenset(
    {"name", "models", *_LIMITS, "budget_period", "weight", "priority", "metadata"}
)  # what `create` and `update` accept


def _optional_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


@dataclass(frozen=True, slots=True)
class TeamRecord(BudgetCounters):
    id: str
    name: str
    created_at_ms: int
    updated_at_ms: int | None
    models: tuple[str, ...]
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    token_budget: int | None
    budget_period: str
    budget_micros: int | None  # budget_usd in integer micro-units
    weight: float
    priority: str
    tokens_spent: int
    period_key: str
    period_spent: int
    spend_micros: int
    period_spend_micros: int
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    metadata: dict[str, Any]
    version: int
    num_keys: int = 0  # members

    @classmethod
    def from_hash(cls, raw: Mapping[str, str], *, num_keys: int = 0) -> TeamRecord:
        return cls(
            id=raw["id"],
            name=raw.get("name", ""),
            created_at_ms=int(raw.get("created_at") or 0),
            updated_at_ms=_optional_int(raw.get("updated_at")),
            models=tuple(orjson.loads(raw.get("models") or "[]")),
            rpm=_optional_int(raw.get("rpm")),
            tpm=_optional_int(raw.get("tpm")),
            max_concurrent=_optional_int(raw.get("max_concurrent")),
            token_budget=_optional_int(raw.get("token_budget")),
            budget_period=raw.get("budget_period") or "total",
            budget_micros=_optional_int(raw.get("budget_micros")),
            weight=float(raw.get("weight") or 1.0),
            priority=raw.get("priority") or "normal",
            tokens_spent=int(raw.get("tokens_spent") or 0),
            period_key=raw.get("period_key", ""),
            period_spent=int(raw.get("period_spent") or 0),
            spend_micros=int(raw.get("spend_micros") or 0),
            period_spend_micros=int(raw.get("period_spend_micros") or 0),
            num_requests=int(raw.get("num_requests") or 0),
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            metadata=orjson.loads(raw.get("metadata") or "{}"),
            version=int(raw.get("version") or 0),
            num_keys=num_keys,
        )


def _check(values: Mapping[str, Any]) -> dict[str, Any]:
    """Refuse what a team cannot hold (400 naming the field); the admin API validates its bodies first, this
    guards every other caller."""
    for name, value in values.items():
        if name not in _SETTABLE:
            raise InvalidRequestError(f"Unknown team field '{name}'.", param=name)
        if name in _LIMITS and value is not None:
            low = 1 if name == "max_concurrent" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"'{name}' must be an integer ≥ {low} or null.", param=name)
        elif name == "weight" and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0
        ):
            raise InvalidRequestError("'weight' must be a number > 0.", param="weight")
        elif name == "priority" and value not in _PRIORITIES:
            raise InvalidRequestError("'priority' must be one of high, normal, low.", param="priority")
        elif name == "budget_period" and value not in _PERIODS:
            raise InvalidRequestError("'budget_period' must be one of total, day, month.", param="budget_period")
        elif name in ("name", "models", "metadata") and value is None:
            raise InvalidRequestError(f"'{name}' cannot be null; send a value or leave it out.", param=name)
    fields = dict(values)
    if "models" in fields:
        fields["models"] = list(fields["models"])
    if "weight" in fields:
        fields["weight"] = float(fields["weight"])
    return fields


class TeamStore:
    """Team records over one Redis client, a single server or a cluster."""

    def __init__(self, redis: RedisClient, scripts: ScriptSet = DEFAULT_SCRIPTS) -> None:
        self.redis = redis
        self.scripts = scripts
        self.keys = KeyStore(redis, scripts=scripts)  # members' records, and the shared record/usage helpers

    async def _announce(self, team_id: str) -> None:
        async with storage_errors():
            await self.redis.publish(redis_names.EVENTS_CHANNEL, team_id)

    async def create(
        self,
        *,
        name: str,
        models: Sequence[str] = (),
        rpm: int | None = None,
        tpm: int | None = None,
        max_concurrent: int | None = None,
        token_budget: int | None = None,
        budget_period: str = "total",
        budget_micros: int | None = None,
        weight: float = 1.0,
        priority: str = "normal",
        metadata: Mapping[str, Any] | None = None,
    ) -> TeamRecord:
        values = _check(
            {
                "name": name,
                "models": models,
                "rpm": rpm,
                "tpm": tpm,
                "max_concurrent": max_concurrent,
                "token_budget": token_budget,
                "budget_period": budget_period,
                "budget_micros": budget_micros,
                "weight": weight,
                "priority": priority,
                "metadata": dict(metadata or {}),
            }
        )
        team_id = new_team_id()
        record = encode_fields(values)
        record.update(id=team_id, created_at=str(await self.keys.now_ms()), version="1")
        async with storage_errors():
            position = await self.redis.incr(redis_names.TEAM_SEQUENCE)
            # Record first, listing entry second (two slots in a cluster): a failure between them leaves a team
            # nobody lists, never a listed id without a record.
            await self.redis.hset(redis_names.team_record(team_id), mapping=record)  # type: ignore[arg-type]
            await self.redis.zadd(redis_names.TEAM_INDEX, {team_id: position})
        return TeamRecord.from_hash(record)

    async def get(self, team_id: str) -> TeamRecord:
        """404 `team_not_found` when there is no such team."""
        raw = await self.keys.hgetall(redis_names.team_record(team_id)) if is_team_id(team_id) else {}
        if "id" not in raw:
            raise team_not_found(team_id)
        async with storage_errors():
            num_keys = int(await self.redis.scard(redis_names.team_members(team_id)))
        return TeamRecord.from_hash(raw, num_keys=num_keys)

    async def list(
        self, *, limit: int = 100, cursor: str | None = None
    ) -> tuple[builtins.list[TeamRecord], str | None]:
        """Teams in creation order, `limit` at a time, after the team `cursor` (the previous page's next_cursor);
        next_cursor is None on the last page."""
        async with storage_errors():
            page, has_more = await index_page(self.redis, redis_names.TEAM_INDEX, cursor, limit, what="a team")
            async with self.redis.pipeline(transaction=False) as pipe:
                for team_id in page:
                    pipe.hgetall(redis_names.team_record(team_id))
                    pipe.scard(redis_names.team_members(team_id))
                replies = await pipe.execute()
        records = [
            TeamRecord.from_hash({as_text(k): as_text(v) for k, v in raw.items()}, num_keys=int(num_keys))
            for raw, num_keys in zip(replies[::2], replies[1::2], strict=True)
            if raw
        ]
        return records, (page[-1] if has_more and page else None)

    async def update(self, team_id: str, changes: Mapping[str, Any]) -> TeamRecord:
        """Change fields (None clears a limit or the budget); a change of `budget_period` recounts the new period's
        spend from the team's usage, as for a key. Every instance drops its cached principals of the team's keys."""
        fields = encode_fields(_check(changes))
        if not is_team_id(team_id) or not await scripts.update_team(
            self.redis, team_id=team_id, fields=fields, scripts=self.scripts
        ):
            raise team_not_found(team_id)
        await self._announce(team_id)
        return await self.get(team_id)

    async def members(self, team_id: str) -> builtins.list[str]:
        """The ids of the team's keys (404 when there is no such team). Each is checked against its record, which
        is what admission reads: a key whose record names another team (a move that failed midway) is dropped."""
        await self.get(team_id)
        async with storage_errors():
            ids = sorted(as_text(raw) for raw in await self.redis.smembers(redis_names.team_members(team_id)))
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hget(redis_names.key_record(key_id), "team_id")
                teams = await pipe.execute()
            stale = [
                key_id for key_id, team in zip(ids, teams, strict=True) if team is None or as_text(team) != team_id
            ]
            if stale:
                await self.redis.srem(redis_names.team_members(team_id), *stale)
        return [key_id for key_id in ids if key_id not in stale]

    async def delete(self, team_id: str, *, force: bool = False) -> None:
        """Delete the team with its state and usage. A team with keys is refused (400 `team_has_keys`) unless
        `force`, which first takes every key out of the team (each keeps its own limits and usage history)."""
        members = await self.members(team_id)
        if members and not force:
            raise InvalidRequestError(
                f"Team '{team_id}' has {len(members)} key(s). Move them to another team or out of it first, or "
                "delete with force (`DELETE /admin/teams/{id}?force=true`, `unigate teams delete --force`), which "
                "detaches them.",
                code="team_has_keys",
            )
        for key_id in members:
            await self.keys.update(key_id, {"team_id": None})
        state_id = redis_names.team_state_id(team_id)
        async with storage_errors():
            days = await self.redis.zrange(redis_names.key_usage_days(state_id), 0, -1)
        names = [
            redis_names.team_record(team_id),
            redis_names.team_members(team_id),
            *(
                fn(state_id)
                for fn in (
                    redis_names.key_rpm_log,
                    redis_names.key_tpm_log,
                    redis_names.key_tpm_sum,
                    redis_names.key_leases,
                    redis_names.key_holds,
                    redis_names.key_holds_sum,
                    redis_names.key_usage_days,
                    redis_names.key_usage_total,
                )
            ),
            *(redis_names.key_usage_day(state_id, as_text(day)) for day in days),
        ]
        async with storage_errors():
            # One slot: one DEL (a cluster accepts it), the record with the rest; the listing entry after.
            if is_cluster(self.redis):
                for start in range(0, len(names), 500):
                    await self.redis.delete(*names[start : start + 500])
            else:
                await self.redis.delete(*names)
            await self.redis.zrem(redis_names.TEAM_INDEX, team_id)
        await self._announce(team_id)

    async def usage(
        self, team_id: str, *, num_days: int | None = None, start: str | None = None, end: str | None = None
    ) -> builtins.list[UsageRow]:
        """What the team's keys spent while in the team, per model per UTC day, oldest first (the last `num_days`
        days, or the days `start`..`end`, YYYY-MM-DD, when given): the rows of `KeyStore.usage`."""
        await self.get(team_id)
        return await self.keys.usage_of(redis_names.team_state_id(team_id), num_days=num_days, start=start, end=end)

    async def usage_many(
        self, team_ids: Sequence[str], *, num_days: int | None = None
    ) -> dict[str, builtins.list[UsageRow]]:
        """`usage` of many teams at once (unknown ids with no rows), as `KeyStore.usage_many`."""
        rows = await self.keys.usage_many([redis_names.team_state_id(t) for t in team_ids], num_days=num_days)
        return {team_id: rows[redis_names.team_state_id(team_id)] for team_id in team_ids}

    async def totals(self, team_id: str, *, num_days: int | None = None) -> UsageTotals:
        """`KeyStore.totals` for one team: its lifetime usage per model and per UTC day, and its keys."""
        now = await self.keys.now_ms()
        totals = UsageTotals()
        for key_id in await self.members(team_id):
            record = await self.keys.get(key_id)
            totals.num_keys += 1
            totals.num_active_keys += int(not record.is_revoked and not record.is_expired(now))
        return await self.keys.sum_usage([redis_names.team_state_id(team_id)], totals, now_ms=now, num_days=num_days)
