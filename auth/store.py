"""`KeyStore`: key records in Redis — create, read, list, update, rotate, revoke — and their usage.

A record is one hash (`redis_names.key_record`); the secret exists only in the return value of `create` and
`rotate`, and at rest only as its SHA-256 (`ug:keyhash:<sha256>` → id). Every change bumps the record's version
and is announced on `ug:events`, so gateway instances drop their cached copy at once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from auth import redis_names, scripts
from auth.keys import display_prefix, generate_key, hash_key, is_key_id, is_team_id, new_key_id
from auth.redis_client import RedisClient, is_cluster
from auth.scripts import DEFAULT_SCRIPTS, ScriptSet, as_text, storage_errors
from gateway.errors import InvalidRequestError, NotFoundError

__all__ = [
    "BudgetPeriod",
    "KeyPage",
    "KeyRecord",
    "KeyStore",
    "UsageRow",
    "UsageTotals",
    "encode_fields",
    "period_key",
    "rows_from_hash",
    "team_not_found",
]

# Commands per pipelined round trip in `KeyStore.usage_many` (replies of a few hundred bytes each).
_PIPELINE_BATCH = 1000

BudgetPeriod = Literal["total", "day", "month"]


def period_key(budget_period: str, now_ms: int) -> str:
    """The budget period containing `now_ms`, named as the Lua scripts name it ("" for a lifetime budget)."""
    day = dt.datetime.fromtimestamp(now_ms / 1000, tz=dt.UTC)
    if budget_period == "day":
        return day.strftime("d:%Y-%m-%d")
    if budget_period == "month":
        return day.strftime("m:%Y-%m")
    return ""


def _day_number(date: str) -> int:
    """A UTC day "YYYY-MM-DD" as days since the epoch (the score of a usage_days entry); 400 when unreadable."""
    try:
        return (dt.date.fromisoformat(date) - dt.date(1970, 1, 1)).days
    except ValueError:
        raise InvalidRequestError(f"Invalid date '{date}': expected YYYY-MM-DD.", param="start") from None


def team_not_found(team_id: str) -> NotFoundError:
    return NotFoundError(
        f"No team with id '{team_id}'. List teams with `GET /admin/teams` (or `unigate teams list`).",
        code="team_not_found",
    )


def _optional_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


class BudgetCounters:
    """What a key record and a team record both answer from their counters: what counts against a budget now."""

    __slots__ = ()
    budget_period: str
    tokens_spent: int
    period_key: str
    period_spent: int
    spend_micros: int
    period_spend_micros: int

    def budget_spent(self, now_ms: int) -> int:
        """Tokens counted against the budget now: lifetime, or the current day/month."""
        if self.budget_period == "total":
            return self.tokens_spent
        return self.period_spent if self.period_key == period_key(self.budget_period, now_ms) else 0

    def budget_spend_micros(self, now_ms: int) -> int:
        """Spend (micro-units) counted against `budget_usd` now: lifetime, or the current day/month."""
        if self.budget_period == "total":
            return self.spend_micros
        return self.period_spend_micros if self.period_key == period_key(self.budget_period, now_ms) else 0


@dataclass(frozen=True, slots=True)
class KeyRecord(BudgetCounters):
    id: str
    name: str
    key_hash: str
    key_prefix: str
    created_at_ms: int
    updated_at_ms: int | None
    expires_at_ms: int | None
    is_revoked: bool
    revoked_at_ms: int | None
    rotated_at_ms: int | None
    last_used_at_ms: int | None
    models: tuple[str, ...]
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    token_budget: int | None
    budget_period: str
    tokens_spent: int
    period_key: str
    period_spent: int
    budget_micros: int | None  # budget_usd in integer micro-units
    spend_micros: int  # lifetime spend, integer micro-units
    period_spend_micros: int  # spend in period_key
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    metadata: dict[str, Any]
    version: int
    team_id: str | None = None  # the team whose limits and budgets also apply (None: no team)
    weight: float = 1.0  # the key's share of the local engine when it has no team
    priority: str = "normal"  # "high" | "normal" | "low": the key's class when it has no team

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> KeyRecord:
        return cls(
            id=raw["id"],
            name=raw.get("name", ""),
            key_hash=raw.get("key_hash", ""),
            key_prefix=raw.get("key_prefix", ""),
            created_at_ms=int(raw.get("created_at") or 0),
            updated_at_ms=_optional_int(raw.get("updated_at")),
            expires_at_ms=_optional_int(raw.get("expires_at")),
            is_revoked=raw.get("revoked") == "1",
            revoked_at_ms=_optional_int(raw.get("revoked_at")),
            rotated_at_ms=_optional_int(raw.get("rotated_at")),
            last_used_at_ms=_optional_int(raw.get("last_used_at")),
            models=tuple(orjson.loads(raw.get("models") or "[]")),
            rpm=_optional_int(raw.get("rpm")),
            tpm=_optional_int(raw.get("tpm")),
            max_concurrent=_optional_int(raw.get("max_concurrent")),
            token_budget=_optional_int(raw.get("token_budget")),
            budget_period=raw.get("budget_period") or "total",
            tokens_spent=int(raw.get("tokens_spent") or 0),
            period_key=raw.get("period_key", ""),
            period_spent=int(raw.get("period_spent") or 0),
            budget_micros=_optional_int(raw.get("budget_micros")),
            spend_micros=int(raw.get("spend_micros") or 0),
            period_spend_micros=int(raw.get("period_spend_micros") or 0),
            num_requests=int(raw.get("num_requests") or 0),
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            metadata=orjson.loads(raw.get("metadata") or "{}"),
            version=int(raw.get("version") or 0),
            team_id=raw.get("team_id") or None,
            weight=float(raw.get("weight") or 1.0),
            priority=raw.get("priority") or "normal",
        )

    def is_expired(self, now_ms: int) -> bool:
        return self.expires_at_ms is not None and self.expires_at_ms <= now_ms


@dataclass(frozen=True, slots=True)
class KeyPage:
    records: list[KeyRecord]
    has_more: bool


@dataclass(frozen=True, slots=True)
class UsageRow:
    date: str  # UTC day, YYYY-MM-DD ("" for lifetime totals)
    model: str
    num_requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int = 0
    num_unpriced: int = 0  # requests that cost 0 because their model had no price
    num_estimated: int = 0  # requests charged the gateway's estimate (no counts reported, e.g. a cut stream)


@dataclass(slots=True)
class UsageTotals:
    num_keys: int = 0
    num_active_keys: int = 0
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    num_unpriced: int = 0
    by_model: list[UsageRow] = field(default_factory=list)
    by_day: list[UsageRow] = field(default_factory=list)  # per UTC day over every key and model (model "")


async def index_page(
    redis: RedisClient, index: str, after: str | None, limit: int, *, what: str
) -> tuple[list[str], bool]:
    """Up to `limit` ids of a creation-ordered index (`ug:keys`, `ug:teams`) after the id `after` (the previous
    page's last), and whether more follow. An `after` not in the index is a 400 naming the `after` parameter."""
    start = 0
    if after is not None:
        rank = await redis.zrank(index, after)
        if rank is None:
            raise InvalidRequestError(
                f"Unknown cursor 'after={after}': pass the id of {what} from the previous page.", param="after"
            )
        start = int(as_text(rank)) + 1
    ids = [as_text(raw) for raw in await redis.zrange(index, start, start + limit)]
    return ids[:limit], len(ids) > limit


def encode_fields(values: Mapping[str, Any]) -> dict[str, str]:
    """Record fields as Redis strings: None → "" (no limit / no expiry), lists and dicts as JSON."""
    encoded: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            encoded[name] = ""
        elif isinstance(value, bool):
            encoded[name] = "1" if value else "0"
        elif isinstance(value, list | tuple | dict):
            encoded[name] = orjson.dumps(value).decode()
        else:
            encoded[name] = str(value)
    return encoded


def rows_from_hash(date: str, raw: Mapping[str, str]) -> list[UsageRow]:
    per_model: dict[str, dict[str, int]] = {}
    for name, value in raw.items():
        model, _, counter = name.rpartition("|")
        per_model.setdefault(model, {})[counter] = int(value)
    return [
        UsageRow(
            date=date,
            model=model,
            num_requests=counters.get("requests", 0),
            prompt_tokens=counters.get("prompt_tokens", 0),
            completion_tokens=counters.get("completion_tokens", 0),
            cost_micros=counters.get("cost_micros", 0),
            num_unpriced=counters.get("unpriced_requests", 0),
            num_estimated=counters.get("estimated_requests", 0),
        )
        for model, counters in sorted(per_model.items())
    ]


def _add(into: dict[str, list[int]], name: str, row: UsageRow) -> None:
    counters = into.setdefault(name, [0, 0, 0, 0, 0, 0])
    counters[0] += row.num_requests
    counters[1] += row.prompt_tokens
    counters[2] += row.completion_tokens
    counters[3] += row.cost_micros
    counters[4] += row.num_unpriced
    counters[5] += row.num_estimated


class KeyStore:
    """Key records over one Redis client, a single server or a cluster (decoding is done here; the client may
    return bytes)."""

    def __init__(self, redis: RedisClient, *, scripts: ScriptSet = DEFAULT_SCRIPTS) -> None:
        self.redis = redis
        self.scripts = scripts

    async def now_ms(self) -> int:
        """Redis' clock, the one every instance agrees on."""
        async with storage_errors():
            seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def hgetall(self, name: str) -> dict[str, str]:
        async with storage_errors():
            raw = await self.redis.hgetall(name)
        return {as_text(k): as_text(v) for k, v in raw.items()}

    async def _announce(self, key_id: str) -> None:
        async with storage_errors():
            await self.redis.publish(redis_names.EVENTS_CHANNEL, key_id)

    async def create(self, values: Mapping[str, Any], *, team_id: str | None = None) -> tuple[KeyRecord, str]:
        """A new key with the given (validated) fields, in team `team_id` (or `values["team_id"]`) when given (404
        `team_not_found` when there is no such team); returns the record and the secret, shown this once."""
        fields = dict(values)
        team_id = fields.pop("team_id", None) or team_id
        secret = generate_key()
        key_id = new_key_id()
        now = await self.now_ms()
        record = encode_fields(fields)
        record.update(
            id=key_id,
            key_hash=hash_key(secret),
            key_prefix=display_prefix(secret),
            created_at=str(now),
            revoked="0",
            version="1",
        )
        if team_id is not None:
            await self._join_team(key_id, team_id)  # before the record names it: see `_join_team`
            record["team_id"] = team_id
        async with storage_errors():
            # Listing order = creation order: a counter, since several keys can share one millisecond.
            position = await self.redis.incr(redis_names.KEY_SEQUENCE)
            await self._write_new(key_id, record, position)
        return KeyRecord.from_hash(record), secret

    async def _join_team(self, key_id: str, team_id: str) -> None:
        """Add the key to the team's member set, BEFORE its record names the team (and leave the old team's set
        only after: `_leave_team`). The record and the set live in different slots, so no write covers both; in
        this order a failure midway leaves the set naming a key that is not (yet, or any more) in the team, never a
        key in a team whose set lacks it. A stale member is harmless (readers check each member's record and drop
        it); a missing one would let a team with keys be deleted under them."""
        if not is_team_id(team_id):
            raise team_not_found(team_id)
        async with storage_errors():
            if not await self.redis.exists(redis_names.team_record(team_id)):
                raise team_not_found(team_id)
            await self.redis.sadd(redis_names.team_members(team_id), key_id)

    async def _leave_team(self, key_id: str, team_id: str) -> None:
        """Drop the key from a team's set once its record no longer names that team (re-read, so that a concurrent
        move back into it keeps its membership)."""
        if (await self.get(key_id)).team_id == team_id:
            return
        async with storage_errors():
            await self.redis.srem(redis_names.team_members(team_id), key_id)

    async def _write_new(self, key_id: str, record: dict[str, str], position: int) -> None:
        """The record, its listing entry and its hash → id lookup: one MULTI on a single server. In a cluster the
        three live in three slots, so they are written one by one, the lookup last: until then the secret (which
        nobody has seen yet) matches nothing, and a failure midway leaves at most an unusable record."""
        record_name, hash_name = redis_names.key_record(key_id), redis_names.key_hash_name(record["key_hash"])
        if is_cluster(self.redis):
            await self.redis.hset(record_name, mapping=record)  # type: ignore[arg-type]
            await self.redis.zadd(redis_names.KEY_INDEX, {key_id: position})
            await self.redis.set(hash_name, key_id)
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(record_name, mapping=record)  # type: ignore[arg-type]
            pipe.zadd(redis_names.KEY_INDEX, {key_id: position})
            pipe.set(hash_name, key_id)
            await pipe.execute()

    async def get(self, key_id: str) -> KeyRecord:
        raw = await self.hgetall(redis_names.key_record(key_id)) if is_key_id(key_id) else {}
        if "key_hash" not in raw:
            raise NotFoundError(
                f"No key with id '{key_id}'. List keys with `GET /admin/keys` (or `unigate keys list`).",
                code="key_not_found",
            )
        return KeyRecord.from_hash(raw)

    async def find_id(self, key_hash: str) -> str | None:
        async with storage_errors():
            key_id = await self.redis.get(redis_names.key_hash_name(key_hash))
        return as_text(key_id) if key_id is not None else None

    async def find_by_secret(self, secret: str) -> KeyRecord | None:
        """The record whose current secret is `secret` (by hash), or None."""
        key_hash = hash_key(secret)
        key_id = await self.find_id(key_hash)
        if key_id is None:
            return None
        raw = await self.hgetall(redis_names.key_record(key_id))
        return KeyRecord.from_hash(raw) if raw.get("key_hash") == key_hash else None

    async def list_keys(self, *, limit: int, after: str | None = None) -> KeyPage:
        """Keys in creation order, `limit` at a time, starting after the key `after`."""
        async with storage_errors():
            ids, has_more = await index_page(self.redis, redis_names.KEY_INDEX, after, limit, what="a key")
            async with self.redis.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(redis_names.key_record(key_id))
                raws = await pipe.execute()
        records = [KeyRecord.from_hash({as_text(k): as_text(v) for k, v in raw.items()}) for raw in raws if raw]
        return KeyPage(records=records, has_more=has_more)

    async def update(self, key_id: str, values: Mapping[str, Any]) -> KeyRecord:
        """Change fields (None clears a limit or the expiry; `team_id` moves the key to another team, None takes it
        out of its team: its own usage history stays with it); the new version reaches every cache at once."""
        old_team: str | None = None
        if "team_id" in values:
            old_team = (await self.get(key_id)).team_id
            if values["team_id"] is not None and values["team_id"] != old_team:
                await self._join_team(key_id, values["team_id"])
        if not is_key_id(key_id) or not await scripts.update_key(
            self.redis, key_id=key_id, fields=encode_fields(values), scripts=self.scripts
        ):
            await self.get(key_id)  # raises key_not_found
        await self._announce(key_id)
        if old_team is not None and values["team_id"] != old_team:
            await self._leave_team(key_id, old_team)
        return await self.get(key_id)

    async def revoke(self, key_id: str) -> KeyRecord:
        """Mark the key revoked (kept for its usage history; its secret answers `key_revoked` from now on)."""
        record = await self.get(key_id)
        if record.is_revoked:
            return record
        return await self.update(key_id, {"revoked": True, "revoked_at": await self.now_ms()})

    async def rotate(self, key_id: str) -> tuple[KeyRecord, str]:
        """A new secret for the same id and settings; the old secret stops working immediately."""
        record = await self.get(key_id)
        if record.is_revoked:
            raise InvalidRequestError(
                f"Key '{key_id}' is revoked and cannot be rotated. Create a new key instead.", code="key_revoked"
            )
        secret = generate_key()
        new_hash = hash_key(secret)
        async with storage_errors():
            await self.redis.set(redis_names.key_hash_name(new_hash), key_id)
        # The record's key_hash is what admission compares, so this one write is the moment the old secret dies.
        fields = {"key_hash": new_hash, "key_prefix": display_prefix(secret), "rotated_at": await self.now_ms()}
        rotated = await self.update(key_id, fields)
        async with storage_errors():
            await self.redis.delete(redis_names.key_hash_name(record.key_hash))
        return rotated, secret

    async def usage(self, key_id: str, *, num_days: int | None = None) -> list[UsageRow]:
        """Requests and tokens per model per UTC day, oldest first (the last `num_days` days when given); `key_id`
        may also be `redis_names.MASTER_ID` (the master key's own usage)."""
        if key_id != redis_names.MASTER_ID:
            await self.get(key_id)
        return await self.usage_of(key_id, num_days=num_days)

    async def usage_of(
        self, state_id: str, *, num_days: int | None = None, start: str | None = None, end: str | None = None
    ) -> list[UsageRow]:
        """The usage recorded under a state id (a key's id, "master", or "team:<team id>"), without checking that
        its owner exists: the last `num_days` days, or the UTC days `start`..`end` (YYYY-MM-DD, both included)."""
        low: float | str = "-inf" if start is None else _day_number(start)
        high: float | str = "+inf" if end is None else _day_number(end)
        if num_days is not None:
            low = (await self.now_ms()) // 86_400_000 - num_days + 1
        async with storage_errors():
            days = await self.redis.zrangebyscore(redis_names.key_usage_days(state_id), low, high)
        rows: list[UsageRow] = []
        for day in days:
            date = as_text(day)
            rows += rows_from_hash(date, await self.hgetall(redis_names.key_usage_day(state_id, date)))
        return rows

    async def usage_many(self, key_ids: Sequence[str], *, num_days: int | None = None) -> dict[str, list[UsageRow]]:
        """`usage` of many keys at once (ids as listed, unknown ones with no rows; the last `num_days` days when
        given), in a few pipelined round trips instead of 3 + days per key: each key's day index, then every (key,
        day) hash, `_PIPELINE_BATCH` commands per round trip (a cluster's pipeline sends each to its slot's node)."""
        low: float | str = "-inf"
        if num_days is not None:
            low = (await self.now_ms()) // 86_400_000 - num_days + 1
        indexes = await self._pipelined(
            [("zrangebyscore", redis_names.key_usage_days(key_id), low, "+inf") for key_id in key_ids]
        )
        wanted = [(key_id, as_text(day)) for key_id, days in zip(key_ids, indexes, strict=True) for day in days]
        hashes = await self._pipelined([("hgetall", redis_names.key_usage_day(key_id, day)) for key_id, day in wanted])
        rows: dict[str, list[UsageRow]] = {key_id: [] for key_id in key_ids}
        for (key_id, day), raw in zip(wanted, hashes, strict=True):
            rows[key_id] += rows_from_hash(day, {as_text(k): as_text(v) for k, v in raw.items()})
        return rows

    async def _pipelined(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        replies: list[Any] = []
        for start in range(0, len(commands), _PIPELINE_BATCH):
            async with storage_errors(), self.redis.pipeline(transaction=False) as pipe:
                for name, *args in commands[start : start + _PIPELINE_BATCH]:
                    getattr(pipe, name)(*args)
                replies += await pipe.execute()
        return replies

    async def totals(self, *, num_days: int | None = None) -> UsageTotals:
        """Lifetime totals over every key (and the master key), per model, and per UTC day (the last `num_days`
        days when given, else every day still retained)."""
        async with storage_errors():
            ids = [as_text(raw) for raw in await self.redis.zrange(redis_names.KEY_INDEX, 0, -1)]
        now = await self.now_ms()
        totals = UsageTotals()
        for key_id in ids:
            raw = await self.hgetall(redis_names.key_record(key_id))
            if "key_hash" in raw:
                record = KeyRecord.from_hash(raw)
                totals.num_keys += 1
                totals.num_active_keys += int(not record.is_revoked and not record.is_expired(now))
        return await self.sum_usage([*ids, redis_names.MASTER_ID], totals, now_ms=now, num_days=num_days)

    async def sum_usage(
        self, state_ids: Sequence[str], totals: UsageTotals, *, now_ms: int, num_days: int | None = None
    ) -> UsageTotals:
        """Add the lifetime usage per model and the usage per UTC day (the last `num_days` days when given) of
        every state id (a key's id, "master", "team:<team id>") into `totals`."""
        low: float | str = "-inf" if num_days is None else now_ms // 86_400_000 - num_days + 1
        per_model: dict[str, list[int]] = {}
        per_day: dict[str, list[int]] = {}
        for state_id in state_ids:
            for row in rows_from_hash("", await self.hgetall(redis_names.key_usage_total(state_id))):
                _add(per_model, row.model, row)
            async with storage_errors():
                days = await self.redis.zrangebyscore(redis_names.key_usage_days(state_id), low, "+inf")
            for day in map(as_text, days):
                for row in rows_from_hash(day, await self.hgetall(redis_names.key_usage_day(state_id, day))):
                    _add(per_day, day, row)
        for model, counters in sorted(per_model.items()):
            row = UsageRow("", model, *counters)
            totals.by_model.append(row)
            totals.num_requests += row.num_requests
            totals.prompt_tokens += row.prompt_tokens
            totals.completion_tokens += row.completion_tokens
            totals.cost_micros += row.cost_micros
            totals.num_unpriced += row.num_unpriced
        totals.by_day = [UsageRow(day, "", *counters) for day, counters in sorted(per_day.items())]
        return totals
