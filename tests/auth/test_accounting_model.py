"""The accounting, proven against a reference model: the real Lua scripts on a real Redis, driven through the real
`RedisAccess` and `KeyStore`, next to a small pure-Python model of what every limit, budget and usage counter
must be. Hypothesis picks the steps (create keys, set and unset each limit, admit with random estimates, settle
above / below / at the reservation, fail before the first token, drop mid-stream, settle twice, rotate, revoke,
move the clock across minutes, UTC days and months); after every step the Redis state must equal the model's.

Teams: a team is modelled like a key (the same limits, logs, holds and usage, under its own names); keys move in
and out of teams, and a request of a key in a team is admitted by both or charged to neither (a refusal by one
side leaves no entry on the other: the invariants compare every log of both), settled on both with the same
usage. Two requests admitted at once (their admissions pipelined together) must each be explained by the model:
an admitted pair fits in some serial order, and a refusal would be one with the other request counted.

Time: the scripts read the clock through one prelude function, `now_ms()`. `ScriptSet(clock_key=...)` builds the
same scripts with `now_ms()` reading an integer (ms) from a Redis key that the test sets, so the test moves time
forward by hours or months in one step without `DEBUG` commands, sleeping, or touching the system clock. Only the
prelude differs from production; every line of the scripts' bodies is the shipped one. Redis' own key TTLs still
run on real time, which is far shorter than any example's run (every example finishes in well under a minute).

`UNIGATE_ACCOUNTING_EXAMPLES` raises the number of examples (default 25) for a longer search.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import os
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from auth import redis_names
from auth.access import AccessConfig, RedisAccess
from auth.base import Admission, BudgetCost, SettleUsage
from auth.redis_client import connect
from auth.scripts import ScriptSet
from auth.store import KeyStore, period_key
from auth.teams import TeamStore
from gateway.errors import GatewayError
from gateway.routing_config import PricingConfig

CLOCK_KEY = "ug:test:clock"
WINDOW_MS = 60_000
LEASE_TTL_MS = 600_000
START_MS = int(dt.datetime(2026, 1, 31, 23, 58, tzinfo=dt.UTC).timestamp() * 1000)  # a minute, day, month edge
PRICING = PricingConfig(input_per_mtok=Decimal("0.15"), output_per_mtok=Decimal("0.6"))
MODELS = ("priced", "free")  # "free" has no price: it costs 0 and is counted as unpriced
NUM_EXAMPLES = int(os.environ.get("UNIGATE_ACCOUNTING_EXAMPLES", "25"))

limit = st.none() | st.integers(0, 6)
token_limit = st.none() | st.integers(0, 400)
concurrency = st.none() | st.integers(1, 3)
usd_budget = st.none() | st.sampled_from([Decimal(0), Decimal("0.000020"), Decimal("0.0001")])
periods = st.sampled_from(["total", "day", "month"])
TEAM_MODELS = st.sampled_from([(), ("priced", "free"), ("priced",), ("free", "fallback")])
LIMIT_STRATEGIES = {
    "rpm": limit,
    "tpm": token_limit,
    "max_concurrent": concurrency,
    "token_budget": token_limit,
    "budget_micros": st.none() | st.integers(0, 150),
    "budget_period": periods,
}


def _day(now_ms: int) -> str:
    return dt.datetime.fromtimestamp(now_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d")


@dataclass
class KeyModel:
    id: str
    secret: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    token_budget: int | None = None
    budget_micros: int | None = None
    budget_period: str = "total"
    is_revoked: bool = False
    old_secrets: list[str] = field(default_factory=list)
    rpm_log: list[int] = field(default_factory=list)  # admit times
    tpm_log: dict[str, tuple[int, int]] = field(default_factory=dict)  # member → (time, tokens)
    leases: dict[str, int] = field(default_factory=dict)  # lease id → expiry
    holds: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # hold member → (expiry, tokens, micros)
    excess: list[int] = field(default_factory=lambda: [0, 0])  # tokens, micros charged above their holds
    is_budget_fixed: bool = True  # no budget field changed since creation: the guarantee is checked
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_spent: int = 0
    spend_micros: int = 0
    period_key: str = ""
    period_spent: int = 0
    period_spend_micros: int = 0
    usage_days: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    usage_total: dict[str, list[int]] = field(default_factory=dict)
    team: KeyModel | None = None  # a key's team (a team is modelled as a key: `team_id` set, `id` its state id)
    models: tuple[str, ...] = ()  # a team's allowlist (the keys here have none)
    team_id: str | None = None  # set on a team's model only

    def live_tokens(self, now: int) -> int:
        return sum(tokens for time, tokens in self.tpm_log.values() if time > now - WINDOW_MS)

    def budget_spent(self, now: int) -> tuple[int, int]:
        if self.budget_period == "total":
            return self.tokens_spent, self.spend_micros
        if self.period_key == period_key(self.budget_period, now):
            return self.period_spent, self.period_spend_micros
        return 0, 0

    @property
    def is_budgeted(self) -> bool:
        return self.token_budget is not None or self.budget_micros is not None

    def held(self, now: int) -> tuple[int, int]:
        live = [(tokens, micros) for expiry, tokens, micros in self.holds.values() if expiry > now]
        return sum(t for t, _ in live), sum(m for _, m in live)

    def decide(self, now: int, estimate: int, hold: tuple[int, int] = (0, 0)) -> str:
        """The admission decision, in the script's order of checks."""
        if self.is_revoked:
            return "key_revoked"
        spent, spent_micros = self.budget_spent(now)
        held, held_micros = self.held(now)
        if self.token_budget is not None and (spent >= self.token_budget or spent + held + hold[0] > self.token_budget):
            return "budget_exceeded"
        if self.budget_micros is not None and (
            spent_micros >= self.budget_micros or spent_micros + held_micros + hold[1] > self.budget_micros
        ):
            return "budget_exceeded"
        if self.max_concurrent is not None:
            if sum(1 for expiry in self.leases.values() if expiry > now) >= self.max_concurrent:
                return "concurrency_limit_exceeded"
        if self.rpm is not None and sum(1 for t in self.rpm_log if t > now - WINDOW_MS) >= self.rpm:
            return "rate_limit_exceeded"
        if self.tpm is not None and self.live_tokens(now) + estimate > self.tpm:
            return "tokens_limit_exceeded"
        return "ok"

    def change_period(self, budget_period: str, now: int) -> None:
        """A new kind of period starts with what was already spent in it: today's usage, or this month's."""
        if budget_period != self.budget_period and budget_period != "total":
            today = _day(now)
            days = [
                day
                for day in self.usage_days
                if day == today or (budget_period == "month" and day[:7] == today[:7] and day <= today)
            ]
            rows = [row for day in days for row in self.usage_days[day].values()]
            self.period_key = period_key(budget_period, now)
            self.period_spent = sum(row[1] + row[2] for row in rows)
            self.period_spend_micros = sum(row[3] for row in rows)
        self.budget_period = budget_period

    def admit(self, now: int, lease_id: str, estimate: int, hold: tuple[int, int] = (0, 0)) -> None:
        if self.is_budgeted:
            self.holds[f"{lease_id}|{hold[0]}|{hold[1]}"] = (now + LEASE_TTL_MS, *hold)
        if self.rpm is not None:
            self.rpm_log.append(now)
        if self.tpm is not None and estimate > 0:
            self.tpm_log[f"{lease_id}|{estimate}"] = (now, estimate)
        if self.max_concurrent is not None:
            self.leases[lease_id] = now + LEASE_TTL_MS

    def settle(self, now: int, lease_id: str, reserved: int, prompt: int, completion: int, model: str) -> None:
        used = prompt + completion
        self.leases.pop(lease_id, None)
        for member in [m for m in self.holds if m.startswith(f"{lease_id}|")]:
            _, hold_tokens, hold_micros = self.holds.pop(member)
            self.excess[0] += max(used - hold_tokens, 0)
            self.excess[1] += max(
                (PRICING.cost_micros(prompt, completion) if model == "priced" else 0) - hold_micros, 0
            )
        member = f"{lease_id}|{reserved}"
        entry = self.tpm_log.get(member)
        if entry is not None and entry[0] > now - WINDOW_MS:
            del self.tpm_log[member]
            if used > 0:
                self.tpm_log[f"{lease_id}|{used}"] = (entry[0], used)
        elif used > reserved and self.tpm is not None:
            self.tpm_log[f"{lease_id}:extra|{used - reserved}"] = (now, used - reserved)
        cost = PRICING.cost_micros(prompt, completion) if model == "priced" else 0
        self.num_requests += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.tokens_spent += used
        self.spend_micros += cost
        period = period_key(self.budget_period, now)
        if period:
            if self.period_key == period:
                self.period_spent += used
                self.period_spend_micros += cost
            else:
                self.period_key, self.period_spent, self.period_spend_micros = period, used, cost
        row = [1, prompt, completion, cost, int(model != "priced")]
        for target in (self.usage_days.setdefault(_day(now), {}), self.usage_total):
            counters = target.setdefault(model, [0, 0, 0, 0, 0])
            for i, value in enumerate(row):
                counters[i] += value


@dataclass
class Request:
    key: KeyModel
    admission: Admission
    estimate: int
    hold: tuple[int, int] = (0, 0)  # the budget hold: worst-case tokens and micros
    team: KeyModel | None = None  # the team admitted with the key (settled with it, wherever the key is now)


def _decide(
    key: KeyModel, now: int, estimate: int, hold: tuple[int, int], team_hold: tuple[int, int], model: str
) -> tuple[str, bool]:
    """The decision on a key's request and whether it was its team's: the key's checks first, then its team's
    (its allowlist first, as the script checks it before the budgets)."""
    expected = key.decide(now, estimate, hold)
    if expected == "ok" and key.team is not None:
        if key.team.models and model not in key.team.models:
            return "model_not_allowed", True
        team_decision = key.team.decide(now, estimate, team_hold)
        return team_decision, team_decision != "ok"
    return expected, False


def _team_hold(team: KeyModel | None, hold_tokens: int, costs: tuple[tuple[str, int], ...]) -> tuple[int, int]:
    """What a team holds: the dearest cost among the requested model and the fallbacks the team may use."""
    allowed = [
        micros
        for i, (name, micros) in enumerate(costs)
        if i == 0 or team is None or not team.models or name in team.models
    ]
    return hold_tokens, max(allowed)


def _usage_rows(raw: dict[bytes, bytes]) -> dict[str, list[int]]:
    names = ("requests", "prompt_tokens", "completion_tokens", "cost_micros", "unpriced_requests")
    rows: dict[str, list[int]] = {}
    for name, value in raw.items():
        model, _, counter = name.decode().rpartition("|")
        rows.setdefault(model, [0, 0, 0, 0, 0])[names.index(counter)] = int(value)
    return rows


class AccountingMachine(RuleBasedStateMachine):
    redis_url = ""
    data_dir = Path(".")

    keys = Bundle("keys")
    teams = Bundle("teams")
    requests = Bundle("requests")
    settled = Bundle("settled")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = START_MS
        self.redis = connect(self.redis_url)
        self.run(self.redis.flushall())
        self.run(self.redis.set(CLOCK_KEY, self.now))
        script_set = ScriptSet(clock_key=CLOCK_KEY)
        self.store = KeyStore(self.redis, scripts=script_set)
        self.team_store = TeamStore(self.redis, scripts=script_set)
        self.access = RedisAccess(
            connect(self.redis_url),
            config=AccessConfig(lease_ttl_s=LEASE_TTL_MS / 1000),
            master_key="sk-ug-master-test-key-0123456789",
            script_set=script_set,
        )
        self.run(self.access.start())
        self.models: list[KeyModel] = []
        self.first_team_model: KeyModel | None = None

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        client = self.access._redis
        self.run(self.access.aclose())
        self.run(client.aclose())
        self.run(self.redis.aclose())
        self.loop.close()

    # -- keys ----------------------------------------------------------------------------------------------------

    @initialize(target=keys)
    def first_key(self) -> KeyModel:
        return self._create({})

    @initialize(target=keys)
    def first_key_in_a_team(self) -> KeyModel:
        """A key in the first team (made here when this runs before `first_team`), so that every run has one."""
        if self.first_team_model is None:
            self.first_team_model = self.create_team(
                rpm=None, tpm=None, max_concurrent=None, token_budget=None, budget_usd=None, budget_period="total"
            )
        return self._create({}, self.first_team_model)

    @initialize(
        target=teams,
        rpm=st.none() | st.integers(1, 6),
        tpm=st.none() | st.integers(100, 400),
        max_concurrent=concurrency,
        budget_usd=st.none() | st.just(Decimal("0.0001")),
        models=TEAM_MODELS,
    )
    def first_team(self, **fields: Any) -> KeyModel:
        """A team from the start (keys join it at creation or by moving), so that most runs have keys in teams."""
        if self.first_team_model is not None:  # made by `first_key_in_a_team`: set the drawn limits on it
            team = self.first_team_model
            assert team.team_id is not None
            budget_usd = fields.pop("budget_usd")
            fields["budget_micros"] = None if budget_usd is None else int(budget_usd * 1_000_000)
            self.run(self.team_store.update(team.team_id, fields))
            for name, value in fields.items():
                setattr(team, name, value)
            return team
        self.first_team_model = self.create_team(**fields, token_budget=None, budget_period="total")
        return self.first_team_model

    @rule(
        target=keys,
        rpm=limit,
        tpm=token_limit,
        max_concurrent=concurrency,
        token_budget=token_limit,
        budget_usd=usd_budget,
        budget_period=periods,
        team=st.none() | teams,
    )
    def create_key(self, team: KeyModel | None, **fields: Any) -> KeyModel:
        return self._create(fields, team)

    def _create(self, fields: dict[str, Any], team: KeyModel | None = None) -> KeyModel:
        record_fields = {name: value for name, value in fields.items() if name != "budget_usd"}
        budget_usd = fields.get("budget_usd")
        budget_micros = None if budget_usd is None else int(budget_usd * 1_000_000)
        team_id = team.team_id if team is not None else None
        record, secret = self.run(self.store.create({**record_fields, "budget_micros": budget_micros}, team_id=team_id))
        key = KeyModel(id=record.id, secret=secret, budget_micros=budget_micros, team=team, **record_fields)
        self.models.append(key)
        return key

    @rule(
        key=keys,
        name=st.sampled_from(["rpm", "tpm", "max_concurrent", "token_budget", "budget_micros", "budget_period"]),
        data=st.data(),
    )
    def change_limit(self, key: KeyModel, name: str, data: st.DataObject) -> None:
        value = data.draw(LIMIT_STRATEGIES[name], label=name)
        self.run(self.store.update(key.id, {name: value}))
        key.is_budget_fixed = key.is_budget_fixed and name not in ("token_budget", "budget_micros", "budget_period")
        if name == "budget_period":
            key.change_period(value, self.now)
        else:
            setattr(key, name, value)

    # -- teams ---------------------------------------------------------------------------------------------------

    @rule(
        target=teams,
        rpm=limit,
        tpm=token_limit,
        max_concurrent=concurrency,
        token_budget=token_limit,
        budget_usd=usd_budget,
        budget_period=periods,
        models=TEAM_MODELS,
    )
    def create_team(self, models: tuple[str, ...] = (), **fields: Any) -> KeyModel:
        budget_usd = fields.pop("budget_usd")
        budget_micros = None if budget_usd is None else int(budget_usd * 1_000_000)
        name = f"team{len(self.models)}"
        record = self.run(self.team_store.create(name=name, models=models, budget_micros=budget_micros, **fields))
        team = KeyModel(
            id=redis_names.team_state_id(record.id),
            secret="",
            team_id=record.id,
            budget_micros=budget_micros,
            models=models,
            **fields,
        )
        self.models.append(team)
        return team

    @rule(
        team=teams,
        name=st.sampled_from(
            ["rpm", "tpm", "max_concurrent", "token_budget", "budget_micros", "budget_period", "models"]
        ),
        data=st.data(),
    )
    def change_team_limit(self, team: KeyModel, name: str, data: st.DataObject) -> None:
        value = data.draw(TEAM_MODELS if name == "models" else LIMIT_STRATEGIES[name], label=name)
        assert team.team_id is not None
        self.run(self.team_store.update(team.team_id, {name: value}))
        team.is_budget_fixed = team.is_budget_fixed and name not in ("token_budget", "budget_micros", "budget_period")
        if name == "budget_period":
            team.change_period(value, self.now)
        else:
            setattr(team, name, value)

    @rule(key=keys, team=st.none() | teams)
    def move_key(self, key: KeyModel, team: KeyModel | None) -> None:
        """Into a team, to another, or out (requests in flight settle on the team they were admitted with)."""
        self.run(self.store.update(key.id, {"team_id": team.team_id if team is not None else None}))
        key.team = team

    @rule(key=keys)
    def rotate(self, key: KeyModel) -> None:
        if key.is_revoked:
            return
        _, secret = self.run(self.store.rotate(key.id))
        key.old_secrets.append(key.secret)
        key.secret = secret

    @rule(key=keys)
    def revoke(self, key: KeyModel) -> None:
        self.run(self.store.revoke(key.id))
        key.is_revoked = True

    # -- requests ------------------------------------------------------------------------------------------------

    @rule(
        target=requests,
        key=keys,
        estimate=st.integers(0, 150),
        model=st.sampled_from(MODELS),
        hold_tokens=st.integers(0, 200),
        costs=st.tuples(st.integers(0, 60), st.integers(0, 60)),
    )
    def admit(self, key: KeyModel, estimate: int, model: str, hold_tokens: int, costs: tuple[int, int]) -> Any:
        """Several requests may be admitted before any settles; each holds its worst case against the budgets
        (the cost: the dearest of the model and its fallback, as every key here may use every model)."""
        hold = (hold_tokens, max(costs))
        priced = ((model, costs[0]), ("fallback", costs[1]))
        team_hold = _team_hold(key.team, hold_tokens, priced)
        expected, is_team_refusal = _decide(key, self.now, estimate, hold, team_hold, model)
        budget = BudgetCost(hold_tokens, priced)
        try:
            admission = self.run(self.access.admit(key.secret, model=model, estimated_tokens=estimate, budget=budget))
        except GatewayError as error:
            assert error.code == expected, (error.code, expected, error.message)
            assert ("team '" in error.message) == is_team_refusal, error.message
            return multiple()
        assert expected == "ok", f"admitted, but the model says {expected}"
        return self._admitted(key, admission, estimate, hold, team_hold)

    def _admitted(
        self, key: KeyModel, admission: Admission, estimate: int, hold: tuple[int, int], team_hold: tuple[int, int]
    ) -> Request:
        assert admission.lease_id is not None
        assert admission.team_id == (key.team.team_id if key.team is not None else None)
        key.admit(self.now, admission.lease_id, estimate, hold)
        if key.team is not None:
            key.team.admit(self.now, admission.lease_id, estimate, team_hold)
        return Request(key, admission, estimate, hold if key.is_budgeted else (0, 0), key.team)

    @rule(
        target=requests,
        first=keys,
        second=keys,
        estimates=st.tuples(st.integers(0, 150), st.integers(0, 150)),
        hold_tokens=st.integers(0, 200),
        cost=st.integers(0, 60),
    )
    def admit_concurrently(
        self, first: KeyModel, second: KeyModel, estimates: tuple[int, int], hold_tokens: int, cost: int
    ) -> Any:
        """Two requests at once (often two keys of one team): their admissions go out together. Each outcome must
        be explained: an admitted pair fits one after the other in some order, an admitted one fits, and a refused
        one is refused by the model with or without the other counted (a cancelled half counts briefly)."""
        hold = (hold_tokens, cost)
        budget = BudgetCost(hold_tokens, (("priced", cost),))
        asks = [(first, estimates[0]), (second, estimates[1])]

        async def both() -> list[Admission | BaseException]:
            return await asyncio.gather(
                *(self.access.admit(k.secret, model="priced", estimated_tokens=e, budget=budget) for k, e in asks),
                return_exceptions=True,
            )

        outcomes = self.run(both())
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, GatewayError):
                raise outcome
        admitted = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, Admission)]
        if len(admitted) == 2:
            assert any(self._fits_in_order(asks, order, hold) for order in ((0, 1), (1, 0))), "both admitted"
        for i, outcome in enumerate(outcomes):
            key, estimate = asks[i]
            alone = _decide(key, self.now, estimate, hold, hold, "priced")[0]
            if isinstance(outcome, Admission):
                assert alone == "ok", f"admitted, but the model says {alone}"
            else:
                assert isinstance(outcome, GatewayError)
                after_other = self._decide_after(asks, 1 - i, i, hold)
                assert outcome.code in (alone, after_other), (outcome.code, alone, after_other)
        requests = []
        for i in admitted:
            admission = outcomes[i]
            assert isinstance(admission, Admission)
            requests.append(self._admitted(asks[i][0], admission, asks[i][1], hold, hold))
        return multiple(*requests)

    def _fits_in_order(self, asks: list[tuple[KeyModel, int]], order: tuple[int, int], hold: tuple[int, int]) -> bool:
        return _decide(asks[order[0]][0], self.now, asks[order[0]][1], hold, hold, "priced")[0] == "ok" and (
            self._decide_after(asks, order[0], order[1], hold) == "ok"
        )

    def _decide_after(self, asks: list[tuple[KeyModel, int]], before: int, then: int, hold: tuple[int, int]) -> str:
        """`then`'s decision with `before` admitted first (on copies of the models)."""
        first_key, first_estimate = asks[before]
        memo: dict[int, Any] = {}
        key_copy, then_copy = copy.deepcopy(first_key, memo), copy.deepcopy(asks[then][0], memo)
        key_copy.admit(self.now, "probe", first_estimate, hold)
        if key_copy.team is not None:
            key_copy.team.admit(self.now, "probe", first_estimate, hold)
        return _decide(then_copy, self.now, asks[then][1], hold, hold, "priced")[0]

    @rule(key=keys, estimate=st.integers(0, 50))
    def admit_with_old_secret(self, key: KeyModel, estimate: int) -> None:
        if not key.old_secrets:
            return
        try:
            self.run(self.access.admit(key.old_secrets[-1], model="priced", estimated_tokens=estimate))
        except GatewayError as error:
            assert error.code == "invalid_api_key", error.code
        else:
            raise AssertionError("a rotated-away secret was admitted")

    @rule(
        target=settled,
        request=consumes(requests),
        shape=st.sampled_from(["above", "below", "equal", "failed_before_first_token", "dropped_mid_stream"]),
        data=st.data(),
    )
    def settle(self, request: Request, shape: str, data: st.DataObject) -> Request:
        reserved = request.estimate
        if shape == "above":
            used = reserved + data.draw(st.integers(1, 200), label="excess")
        elif shape == "below":
            used = data.draw(st.integers(0, max(reserved - 1, 0)), label="used")
        elif shape == "equal":
            used = reserved
        elif shape == "failed_before_first_token":
            used = 0
        else:  # the prompt was read, part of the answer was streamed
            used = data.draw(st.integers(1, reserved + 40), label="partial")
        prompt = data.draw(st.integers(0, used), label="prompt")
        completion = used - prompt
        model = request.admission.model
        cost = PRICING.cost_micros(prompt, completion) if model == "priced" else 0
        self.run(
            self.access.settle(
                request.admission,
                SettleUsage(prompt, completion, cost_micros=cost, is_priced=model == "priced"),
            )
        )
        assert request.admission.lease_id is not None
        request.key.settle(self.now, request.admission.lease_id, reserved, prompt, completion, model)
        if request.team is not None:
            request.team.settle(self.now, request.admission.lease_id, reserved, prompt, completion, model)
        return request

    @rule(request=settled, prompt=st.integers(0, 300), completion=st.integers(0, 300))
    def settle_again(self, request: Request, prompt: int, completion: int) -> None:
        """A retried settle (another instance, a replayed hand-off) reaches the script again: it changes nothing."""
        fresh = replace(request.admission, is_settled=False)
        self.run(self.access.settle(fresh, SettleUsage(prompt, completion)))

    # -- time ----------------------------------------------------------------------------------------------------

    @rule(ms=st.integers(1, 5_000) | st.sampled_from([WINDOW_MS - 1, WINDOW_MS, WINDOW_MS + 1, 3_600_000]))
    def advance(self, ms: int) -> None:
        self._set_clock(self.now + ms)

    @rule(unit=st.sampled_from(["day", "month"]), before_ms=st.integers(-2_000, 2_000))
    def cross_calendar(self, unit: str, before_ms: int) -> None:
        """Jump to within two seconds of the next UTC midnight or the next month's first midnight."""
        moment = dt.datetime.fromtimestamp(self.now / 1000, tz=dt.UTC)
        if unit == "day":
            edge = dt.datetime(moment.year, moment.month, moment.day, tzinfo=dt.UTC) + dt.timedelta(days=1)
        else:
            year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
            edge = dt.datetime(year, month, 1, tzinfo=dt.UTC)
        self._set_clock(max(self.now + 1, int(edge.timestamp() * 1000) + before_ms))

    def _set_clock(self, now: int) -> None:
        self.now = now
        self.run(self.redis.set(CLOCK_KEY, now))

    # -- invariants ----------------------------------------------------------------------------------------------

    @invariant()
    def no_script_or_storage_errors(self) -> None:
        assert self.access.num_script_errors == {}, self.access.num_script_errors
        assert self.access.num_storage_errors == 0

    @invariant()
    def redis_equals_model(self) -> None:
        for key in self.models:
            self.run(self._check_key(key))

    async def _check_key(self, key: KeyModel) -> None:
        redis, now = self.redis, self.now
        record = await (self.team_store.get(key.team_id) if key.team_id is not None else self.store.get(key.id))
        assert (record.num_requests, record.prompt_tokens, record.completion_tokens) == (
            key.num_requests,
            key.prompt_tokens,
            key.completion_tokens,
        )
        assert (record.tokens_spent, record.spend_micros) == (key.tokens_spent, key.spend_micros)
        assert (record.period_key, record.period_spent, record.period_spend_micros) == (
            key.period_key,
            key.period_spent,
            key.period_spend_micros,
        )
        assert (record.budget_spent(now), record.budget_spend_micros(now)) == key.budget_spent(now)

        members = await redis.zrange(redis_names.key_tpm_log(key.id), 0, -1, withscores=True)
        logged = {member.decode(): int(score) for member, score in members}
        total = sum(int(member.rpartition("|")[2]) for member in logged)
        assert int(await redis.get(redis_names.key_tpm_sum(key.id)) or 0) == total, "tpm_sum drifted from its log"
        live = {member for member, score in logged.items() if score > now - WINDOW_MS}
        assert live == {m for m, (t, _) in key.tpm_log.items() if t > now - WINDOW_MS}
        assert sum(int(m.rpartition("|")[2]) for m in live) == key.live_tokens(now)

        holds = await redis.zrange(redis_names.key_holds(key.id), 0, -1, withscores=True)
        assert {m.decode() for m, expiry in holds if expiry > now} == {
            member for member, (expiry, _, _) in key.holds.items() if expiry > now
        }
        # Admission reads what the holds hold in all from their running sums, never from the holds themselves.
        held = (await redis.get(redis_names.key_holds_sum(key.id)) or b"|0|0").decode().split("|")[-2:]
        in_holds = [m.decode().split("|")[-2:] for m, _ in holds]
        assert (int(held[0]), int(held[1])) == (
            sum(int(tokens) for tokens, _ in in_holds),
            sum(int(micros) for _, micros in in_holds),
        ), "the holds' sums drifted from the holds"
        if key.is_budget_fixed and key.budget_period == "total":
            # The guarantee: spend ≤ budget, plus what requests charged above their holds.
            if key.token_budget is not None:
                assert key.tokens_spent <= key.token_budget + key.excess[0]
            if key.budget_micros is not None:
                assert key.spend_micros <= key.budget_micros + key.excess[1]

        leases = await redis.zrange(redis_names.key_leases(key.id), 0, -1, withscores=True)
        assert {m.decode() for m, expiry in leases if expiry > now} == {
            lease for lease, expiry in key.leases.items() if expiry > now
        }

        assert _usage_rows(await redis.hgetall(redis_names.key_usage_total(key.id))) == key.usage_total
        days = {day.decode() for day in await redis.zrange(redis_names.key_usage_days(key.id), 0, -1)}
        assert days == set(key.usage_days)
        for day, rows in key.usage_days.items():
            assert _usage_rows(await redis.hgetall(redis_names.key_usage_day(key.id, day))) == rows


@pytest.mark.timeout(600)
def test_accounting_matches_the_reference_model(redis_url: str, tmp_path: Path) -> None:
    AccountingMachine.redis_url = redis_url
    AccountingMachine.data_dir = tmp_path
    run_state_machine_as_test(
        AccountingMachine,
        settings=settings(
            max_examples=NUM_EXAMPLES,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
