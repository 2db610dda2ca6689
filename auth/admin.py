"""Admin API logic without HTTP: validate the JSON bodies, shape records and usage for output.

Output never contains a secret or its hash; the secret appears only in the `key` field of the create and
rotate responses, added by the route.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any, Literal, TypeVar

import orjson
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from auth.store import KeyRecord, UsageRow, UsageTotals
from auth.teams import TeamRecord
from gateway.errors import InvalidRequestError

__all__ = [
    "KeyCreateBody",
    "KeyUpdateBody",
    "TeamCreateBody",
    "TeamUpdateBody",
    "parse_body",
    "record_json",
    "rfc3339",
    "team_json",
    "team_totals_json",
    "team_usage_json",
    "totals_json",
    "usage_json",
]

_MAX_MODELS = 256
_MAX_BUDGET_USD = 1_000_000_000  # keeps micro-units far inside a Lua double's exact integers
_MAX_LIMIT = 2**53  # limits and token budgets: exact in a Lua double and in JSON readers (JavaScript's safe range)
_MAX_WEIGHT = 1_000_000.0  # a tenant's share of the local engine, relative to others (default 1)
_TEAM_ID = r"^team_[0-9a-f]{16}$"
Priority = Literal["high", "normal", "low"]
BodyT = TypeVar("BodyT", bound=BaseModel)


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text)


def _check_name(name: str | None) -> str | None:
    if name is not None and _has_control(name):
        raise ValueError("names cannot contain control characters (newlines, tabs, NUL)")
    return name


def _check_patterns(models: list[str]) -> list[str]:
    for pattern in models:
        if not pattern or not pattern.strip():
            raise ValueError("model patterns must be non-empty strings")
        if _has_control(pattern):
            raise ValueError(f"model pattern {pattern!r} contains control characters")
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"model pattern {pattern!r}: only exact ids and the wildcards '*' and '?' are supported")
    return models


class KeyCreateBody(BaseModel):
    """`POST /admin/keys`: every field optional; absent limits mean unlimited."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="", max_length=200)
    models: list[str] = Field(default_factory=list, max_length=_MAX_MODELS)
    rpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    tpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=1, le=_MAX_LIMIT)
    token_budget: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    budget_usd: Decimal | None = Field(default=None, ge=0, le=_MAX_BUDGET_USD, decimal_places=6)
    budget_period: Literal["total", "day", "month"] = "total"
    expires_at: AwareDatetime | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    team_id: str | None = Field(default=None, pattern=_TEAM_ID)
    weight: float = Field(default=1.0, gt=0, le=_MAX_WEIGHT, allow_inf_nan=False)
    priority: Priority = "normal"

    _check_models = field_validator("models")(_check_patterns)
    _check_name = field_validator("name")(_check_name)

    def record_fields(self) -> dict[str, Any]:
        return _to_record_fields(self.model_dump())


class KeyUpdateBody(BaseModel):
    """`PATCH /admin/keys/{id}`: only the fields sent change; `null` removes a limit, the budget or the expiry."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=200)
    models: list[str] | None = Field(default=None, max_length=_MAX_MODELS)
    rpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    tpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=1, le=_MAX_LIMIT)
    token_budget: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    budget_usd: Decimal | None = Field(default=None, ge=0, le=_MAX_BUDGET_USD, decimal_places=6)
    budget_period: Literal["total", "day", "month"] | None = None
    expires_at: AwareDatetime | None = None
    metadata: dict[str, Any] | None = None
    team_id: str | None = Field(default=None, pattern=_TEAM_ID)  # moves the key; null takes it out of its team
    weight: float | None = Field(default=None, gt=0, le=_MAX_WEIGHT, allow_inf_nan=False)
    priority: Priority | None = None

    _check_models = field_validator("models")(lambda models: None if models is None else _check_patterns(models))
    _check_name = field_validator("name")(_check_name)

    def record_fields(self) -> dict[str, Any]:
        return _to_record_fields(_changes(self, ("name", "models", "budget_period", "metadata", "weight", "priority")))


class TeamCreateBody(BaseModel):
    """`POST /admin/teams`: a name, and the same limits and budgets as a key's (absent = unlimited), plus the
    team's share of the local engine (`weight`, `priority`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    models: list[str] = Field(default_factory=list, max_length=_MAX_MODELS)
    rpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    tpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=1, le=_MAX_LIMIT)
    token_budget: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    budget_usd: Decimal | None = Field(default=None, ge=0, le=_MAX_BUDGET_USD, decimal_places=6)
    budget_period: Literal["total", "day", "month"] = "total"
    weight: float = Field(default=1.0, gt=0, le=_MAX_WEIGHT, allow_inf_nan=False)
    priority: Priority = "normal"
    metadata: dict[str, Any] = Field(default_factory=dict)

    _check_models = field_validator("models")(_check_patterns)
    _check_name = field_validator("name")(_check_name)

    def record_fields(self) -> dict[str, Any]:
        """Keyword arguments of `TeamStore.create`."""
        return _to_record_fields(self.model_dump())


class TeamUpdateBody(BaseModel):
    """`PATCH /admin/teams/{id}`: only the fields sent change; `null` removes a limit or the budget."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=200)
    models: list[str] | None = Field(default=None, max_length=_MAX_MODELS)
    rpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    tpm: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    max_concurrent: int | None = Field(default=None, ge=1, le=_MAX_LIMIT)
    token_budget: int | None = Field(default=None, ge=0, le=_MAX_LIMIT)
    budget_usd: Decimal | None = Field(default=None, ge=0, le=_MAX_BUDGET_USD, decimal_places=6)
    budget_period: Literal["total", "day", "month"] | None = None
    weight: float | None = Field(default=None, gt=0, le=_MAX_WEIGHT, allow_inf_nan=False)
    priority: Priority | None = None
    metadata: dict[str, Any] | None = None

    _check_models = field_validator("models")(lambda models: None if models is None else _check_patterns(models))
    _check_name = field_validator("name")(_check_name)

    def record_fields(self) -> dict[str, Any]:
        return _to_record_fields(_changes(self, ("name", "models", "budget_period", "metadata", "weight", "priority")))


def _changes(body: BaseModel, not_nullable: tuple[str, ...]) -> dict[str, Any]:
    """The fields a PATCH body sent; `null` is refused where it would not mean "no limit"."""
    changes = body.model_dump(include=body.model_fields_set)
    for name in not_nullable:
        if name in changes and changes[name] is None:
            raise InvalidRequestError(f"'{name}' cannot be null; send a value or leave it out.", param=name)
    return changes


def _to_record_fields(values: dict[str, Any]) -> dict[str, Any]:
    if "expires_at" in values and values["expires_at"] is not None:
        values["expires_at"] = int(values["expires_at"].timestamp() * 1000)
    if "budget_usd" in values:  # stored as integer micro-units, like the spend it is compared with
        budget = values.pop("budget_usd")
        values["budget_micros"] = None if budget is None else int(budget * 1_000_000)
    return values


def usd(micros: int) -> float:
    """Micro-units as a JSON number of currency units (exact to the micro-unit for any real budget)."""
    return micros / 1_000_000


def parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """Validate a JSON body, turning the first problem into a 400 that names the field."""
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise InvalidRequestError("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    try:
        # Strict: a limit is a JSON integer (not `true`, "60" or 60.0); budget_usd a number or decimal string.
        return model.model_validate_json(raw if raw.strip() else b"{}", strict=True)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or None
        raise InvalidRequestError(f"Invalid field '{field}': {error['msg']}.", param=field) from None


def rfc3339(ms: int | None) -> str | None:
    if ms is None:
        return None
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def record_json(record: KeyRecord, now_ms: int) -> dict[str, Any]:
    """The public shape of a key record (no secret, no hash)."""
    budget_spent = record.budget_spent(now_ms)
    spend_micros = record.budget_spend_micros(now_ms)
    return {
        "object": "api_key",
        "id": record.id,
        "name": record.name,
        "key_prefix": record.key_prefix,
        "created_at": rfc3339(record.created_at_ms),
        "updated_at": rfc3339(record.updated_at_ms),
        "expires_at": rfc3339(record.expires_at_ms),
        "revoked": record.is_revoked,
        "revoked_at": rfc3339(record.revoked_at_ms),
        "rotated_at": rfc3339(record.rotated_at_ms),
        "last_used_at": rfc3339(record.last_used_at_ms),
        "is_expired": record.is_expired(now_ms),
        "models": list(record.models),
        "rpm": record.rpm,
        "tpm": record.tpm,
        "max_concurrent": record.max_concurrent,
        "token_budget": record.token_budget,
        "budget_period": record.budget_period,
        "budget_spent": budget_spent,
        "budget_remaining": None if record.token_budget is None else max(record.token_budget - budget_spent, 0),
        "budget_usd": None if record.budget_micros is None else usd(record.budget_micros),
        "budget_usd_spent": usd(spend_micros),
        "budget_usd_remaining": None
        if record.budget_micros is None
        else usd(max(record.budget_micros - spend_micros, 0)),
        "spend_usd": usd(record.spend_micros),
        "tokens_spent": record.tokens_spent,
        "num_requests": record.num_requests,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "team_id": record.team_id,
        "weight": record.weight,
        "priority": record.priority,
        "metadata": record.metadata,
    }


def team_json(team: TeamRecord, now_ms: int) -> dict[str, Any]:
    """The public shape of a team record: its limits, its budgets against what it has spent, its share of the
    local engine and how many keys it has."""
    budget_spent, spend_micros = team.budget_spent(now_ms), team.budget_spend_micros(now_ms)
    return {
        "object": "team",
        "id": team.id,
        "name": team.name,
        "created_at": rfc3339(team.created_at_ms),
        "updated_at": rfc3339(team.updated_at_ms),
        "models": list(team.models),
        "rpm": team.rpm,
        "tpm": team.tpm,
        "max_concurrent": team.max_concurrent,
        "token_budget": team.token_budget,
        "budget_period": team.budget_period,
        "budget_spent": budget_spent,
        "budget_remaining": None if team.token_budget is None else max(team.token_budget - budget_spent, 0),
        "budget_usd": None if team.budget_micros is None else usd(team.budget_micros),
        "budget_usd_spent": usd(spend_micros),
        "budget_usd_remaining": None if team.budget_micros is None else usd(max(team.budget_micros - spend_micros, 0)),
        "spend_usd": usd(team.spend_micros),
        "tokens_spent": team.tokens_spent,
        "num_requests": team.num_requests,
        "prompt_tokens": team.prompt_tokens,
        "completion_tokens": team.completion_tokens,
        "weight": team.weight,
        "priority": team.priority,
        "num_keys": team.num_keys,
        "metadata": team.metadata,
    }


def _row_json(row: UsageRow) -> dict[str, Any]:
    shaped: dict[str, Any] = {"date": row.date} if row.date else {}
    shaped.update(
        model=row.model,
        requests=row.num_requests,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
        total_tokens=row.prompt_tokens + row.completion_tokens,
        spend_usd=usd(row.cost_micros),
        unpriced_requests=row.num_unpriced,
        estimated_requests=row.num_estimated,
    )
    if not row.model:
        del shaped["model"]
    return shaped


def usage_json(key_id: str, rows: list[UsageRow]) -> dict[str, Any]:
    return {"object": "list", "key_id": key_id, "data": [_row_json(row) for row in rows]}


def team_usage_json(team_id: str, rows: list[UsageRow]) -> dict[str, Any]:
    """`GET /admin/teams/{id}/usage`: the team's own rows (every request of a key while it was in the team)."""
    return {"object": "list", "team_id": team_id, "data": [_row_json(row) for row in rows]}


def team_totals_json(team: TeamRecord, totals: UsageTotals) -> dict[str, Any]:
    """`GET /admin/usage?team=<id>`: the shape of `GET /admin/usage` over one team's own usage and keys."""
    return {**totals_json(totals), "team_id": team.id, "team_name": team.name}


def totals_json(totals: UsageTotals) -> dict[str, Any]:
    return {
        "object": "usage",
        "num_keys": totals.num_keys,
        "num_active_keys": totals.num_active_keys,
        "requests": totals.num_requests,
        "prompt_tokens": totals.prompt_tokens,
        "completion_tokens": totals.completion_tokens,
        "total_tokens": totals.prompt_tokens + totals.completion_tokens,
        "spend_usd": usd(totals.cost_micros),
        "unpriced_requests": totals.num_unpriced,
        "by_model": [_row_json(row) for row in totals.by_model],
        "by_day": [_row_json(row) for row in totals.by_day],
    }
