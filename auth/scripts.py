"""The Lua scripts under auth/lua/, each behind one typed wrapper.

Scripts are read from the package (shipped as package data), registered once with SCRIPT LOAD, and called by
SHA; a Redis that restarted or was flushed answers NOSCRIPT, and the call registers the script again and retries
once.

Failures leave this module as one of two types, and the difference matters:
- `StorageError`: Redis could not be reached, timed out, or refused for a server-side state (read-only replica,
  out of memory, loading, busy, cluster down). Callers may fall back on their failure mode, unless
  `is_outage` is False: Redis answered, but with a redirection or a role that says "not here" (MOVED or ASK
  beyond what the cluster pipe follows, TRYAGAIN, READONLY); that is never a reason to skip a limit.
- `ScriptError`: a script of ours raised (a Lua runtime error), answered something we cannot parse, or named keys
  of several cluster slots (CROSSSLOT). That is a bug, never an outage: callers must not skip a limit or enter a
  "Redis is down" state for it.

The time every script reads (`now_ms()`) is Redis' TIME. `ScriptSet(clock_key=...)` builds the same scripts with
a clock read from a Redis string key instead, for tests that move time across minutes, days and months.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.typing import EncodableT

from auth import redis_names
from auth.cluster_pipe import ClusterCommandPipe
from auth.resp_pipe import CommandPipe
from gateway.errors import GatewayError, UnavailableError

__all__ = [
    "DEFAULT_SCRIPTS",
    "MAX_TOKENS",
    "AdmitReply",
    "LuaScript",
    "ScriptError",
    "ScriptSet",
    "SettleItem",
    "StorageError",
    "Target",
    "acquire_upstream",
    "admit_command",
    "admit_reply",
    "admit_request",
    "as_text",
    "cancel_admission",
    "classify_failure",
    "register_all",
    "release_upstream",
    "settle_command",
    "settle_requests",
    "settled_flags",
    "storage_errors",
    "update_key",
    "update_team",
]


class StorageError(UnavailableError):
    """Redis could not be reached or answered with an error (never carries the server address)."""

    code = "storage_unavailable"
    # False when Redis answered but not as the store it should be (a redirection or a read-only replica): callers
    # answer 503 and never bypass a limit for it, whatever the failure mode.
    is_outage = True


Target = Redis | RedisCluster | CommandPipe | ClusterCommandPipe  # what a script can be called on


class ScriptError(GatewayError):
    """A script of ours failed (Lua runtime error) or answered what we cannot parse: a unigate bug, not an outage.
    Rendered as 500 `internal_error`; `script` and `line` say where, for the log and the metric."""

    status_code = 500
    type = "api_error"
    code = "internal_error"

    def __init__(self, script: str, detail: str, *, line_offset: int = 0) -> None:
        super().__init__(
            "The gateway's limit check failed because of an internal error (a bug in unigate, logged with this "
            "request's id). No limit was skipped; retry, and report it if it persists."
        )
        self.script = script
        self.detail = detail
        match = _SCRIPT_LINE.search(detail)
        self.line = max(int(match.group(1)) - line_offset, 0) if match else 0  # the line in `<script>.lua`


_STORAGE_FAILURES = (TimeoutError, RedisError, OSError)
_SCRIPT_LINE = re.compile(r"user_script:(\d+)")
# Error replies that describe the server's state (a read-only replica after a failover, out of memory, still
# loading, a busy script, a cluster that is down or resharding, ACLs): the store is unusable, not our script.
# Inside a script Redis 6 wraps them ("... @user_script:12: -READONLY ..."), Redis 7 starts with them.
_SERVER_STATE = re.compile(
    r"(?:^|-)(?:READONLY|OOM|MISCONF|NOREPLICAS|MASTERDOWN|LOADING|BUSY|CLUSTERDOWN|TRYAGAIN|MOVED|ASK|NOPERM"
    r"|NOAUTH|WRONGPASS)\b"
)
# redis-py maps these replies to their own exception classes and strips the code from the message (it keeps it
# as `status_code`). The first group is not an outage: a redirection, a role, or credentials (no password, a wrong
# one, an ACL user without the commands) — a gateway misconfigured for its Redis must not serve without limits.
_CREDENTIALS = frozenset({"NOPERM", "NOAUTH", "WRONGPASS"})
_NOT_OUTAGES = frozenset({"READONLY", "TRYAGAIN", "MOVED", "ASK"}) | _CREDENTIALS
_SERVER_STATES = _NOT_OUTAGES | {"OOM", "MISCONF", "NOREPLICAS", "MASTERDOWN", "LOADING", "BUSY", "CLUSTERDOWN"}


_STATE_OF_CLASS: tuple[tuple[type[ResponseError], str], ...] = (
    (MovedError, "MOVED"),  # before AskError, its base class
    (AskError, "ASK"),
    (TryAgainError, "TRYAGAIN"),
    (ReadOnlyError, "READONLY"),
    (ClusterDownError, "CLUSTERDOWN"),
    (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"),
)


def _server_state(exc: RedisError) -> str | None:
    """The state an error reply describes ("READONLY", "CLUSTERDOWN", ...), None for any other error."""
    if isinstance(exc, AuthenticationError):  # a ConnectionError in redis-py: NOAUTH / WRONGPASS / AUTH refused
        return "NOAUTH"
    code = getattr(exc, "status_code", None)
    if code in _SERVER_STATES:
        return str(code)
    for error_class, state in _STATE_OF_CLASS:
        if isinstance(exc, error_class):
            return state
    match = _SERVER_STATE.search(str(exc))
    return match.group(0).lstrip("-") if match else None


def classify_failure(exc: BaseException, script: LuaScript) -> StorageError | ScriptError:
    """A failed script call as an outage (`StorageError`), a refusal that is not one (`StorageError` with
    `is_outage` False) or a bug of ours (`ScriptError`, CROSSSLOT included)."""
    if isinstance(exc, ResponseError | AuthenticationError):
        state = _server_state(exc)
        if state is None:
            return ScriptError(script.name, str(exc), line_offset=script.num_prelude_lines)
        return _storage_error(exc, is_outage=state not in _NOT_OUTAGES, state=state)
    if isinstance(exc, ValueError | TypeError | IndexError | KeyError | AttributeError):
        return ScriptError(script.name, f"unreadable reply ({type(exc).__name__}: {exc})")
    return _storage_error(exc)


def _storage_error(exc: BaseException, *, is_outage: bool = True, state: str | None = None) -> StorageError:
    if state in _CREDENTIALS:
        message = (
            f"The key store (Redis) refused the gateway's credentials ({state}); no request is served without its "
            "limits. The gateway operator must set the Redis password / ACL user in REDIS_URL "
            "(redis://user:password@host:6379)."
        )
    else:
        message = (
            f"The key store (Redis) is unavailable ({type(exc).__name__}). Retry shortly; if it persists, check "
            "that Redis is running and reachable from the gateway."
        )
    error = StorageError(message, headers={"retry-after": "1"})
    error.is_outage = is_outage
    return error


@asynccontextmanager
async def storage_errors() -> AsyncIterator[None]:
    """Translate every Redis/socket failure inside the block into `StorageError` (with `is_outage` False for a
    redirection or a read-only replica)."""
    try:
        yield
    except _STORAGE_FAILURES as exc:
        state = _server_state(exc) if isinstance(exc, ResponseError | AuthenticationError) else None
        raise _storage_error(exc, is_outage=state not in _NOT_OUTAGES, state=state) from exc


_LUA_DIR = Path(__file__).parent / "lua"  # shipped as package data (pyproject: auth = ["lua/*.lua"])


def _read_lua(name: str) -> str:
    return (_LUA_DIR / name).read_text(encoding="utf-8")


def _test_clock(clock_key: str) -> str:
    # Reads a key the script does not declare in KEYS: fine on a standalone test server (a cluster refuses it when
    # that key's slot lives on another node), never used in production.
    return f"local function now_ms() return tonumber(redis.call('GET', '{clock_key}')) end"


class LuaScript:
    """One script: its source (clock + calendar prelude + the file), its SHA, and NOSCRIPT recovery."""

    def __init__(self, name: str, *, clock_key: str | None = None, includes: tuple[str, ...] = ()) -> None:
        self.name = name
        clock = _read_lua("_clock.lua") if clock_key is None else _test_clock(clock_key)
        # Shared function files (`auth/lua/_*.lua`) a script uses go in its prelude, in the order given.
        prelude = "\n".join([clock, _read_lua("_calendar.lua"), *(_read_lua(f) for f in includes)])
        self.num_prelude_lines = prelude.count("\n") + 1
        self.source = prelude + "\n" + _read_lua(f"{name}.lua")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def register(self, redis: Target) -> None:
        async with storage_errors():
            await redis.script_load(self.source)

    async def __call__(self, redis: Target, keys: Sequence[str], args: Sequence[EncodableT]) -> Any:
        # The same translation as `storage_errors()`, inlined (this runs twice per request), except that an error
        # raised by the script itself is a `ScriptError`.
        try:
            try:
                return await redis.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                await redis.script_load(self.source)
                return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except _STORAGE_FAILURES as exc:
            raise classify_failure(exc, self) from exc


class ScriptSet:
    """The scripts of one gateway, sharing one clock: Redis TIME, or (tests) the integer in `clock_key` (ms)."""

    def __init__(self, *, clock_key: str | None = None) -> None:
        self.clock_key = clock_key
        self.admit = LuaScript("admit_request", clock_key=clock_key)
        self.settle = LuaScript("settle_request", clock_key=clock_key)
        self.acquire = LuaScript("acquire_upstream", clock_key=clock_key, includes=("_fair_handoff.lua",))
        self.release = LuaScript("release_upstream", clock_key=clock_key, includes=("_fair_handoff.lua",))
        self.update = LuaScript("update_key", clock_key=clock_key)
        self.cancel = LuaScript("cancel_admission", clock_key=clock_key)

    @property
    def all(self) -> tuple[LuaScript, ...]:
        return (self.admit, self.settle, self.acquire, self.release, self.update, self.cancel)


DEFAULT_SCRIPTS = ScriptSet()


async def register_all(redis: Redis | RedisCluster, scripts: ScriptSet = DEFAULT_SCRIPTS) -> None:
    for script in scripts.all:
        await script.register(redis)


def as_text(value: Any) -> str:
    """A Redis reply item as str (the client may hand back bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class AdmitReply:
    status: str
    version: int
    record: dict[str, str]  # empty unless the caller's cached version was stale
    rpm_limit: int  # -1 = no limit
    rpm_remaining: int
    rpm_reset_ms: int
    tpm_limit: int
    tpm_remaining: int
    tpm_reset_ms: int
    retry_after_ms: int
    leases_remaining: int  # concurrency slots still free after this request; -1 = no concurrency limit
    budget_spent: int = 0  # on budget_exceeded: spent in the budget's period, in budget_unit
    budget_limit: int = 0
    budget_unit: str = ""  # "tokens" | "micros" (integer micro-units of the price currency) | ""
    budget_held: int = 0  # on budget_exceeded: what requests in flight hold of the budget, in budget_unit
    budget_needed: int = 0  # on budget_exceeded: this request's reservation, in budget_unit
    reserved_micros: int = 0  # on "ok": the worst-case cost this request holds against `budget_usd` (0: none)


MAX_TOKENS = 2**40  # any token count sent to a script is clamped to [0, MAX_TOKENS] (a Lua double holds it exactly)


def clamp_tokens(value: int) -> int:
    return min(max(int(value), 0), MAX_TOKENS)


def clamp_micros(value: int) -> int:
    return min(max(int(value), 0), 2**50)


def _counter_keys(state_id: str) -> tuple[str, ...]:
    """What an admission counts in and a cancellation gives back: rate logs, leases, budget holds."""
    return (
        redis_names.key_rpm_log(state_id),
        redis_names.key_tpm_log(state_id),
        redis_names.key_tpm_sum(state_id),
        redis_names.key_leases(state_id),
        redis_names.key_holds(state_id),
        redis_names.key_holds_sum(state_id),
    )


@dataclass(slots=True)
class AdmitArgs:
    """One admission's inputs, for `admit_request` / `admit_command`. `state_id` is a key's id, or a team's state id
    (`redis_names.team_state_id`) with `key_hash` "": the team's admission. `budget_tokens` and `costs` ((model,
    worst-case micros) of the requested model, then its fallbacks) are what a budgeted key reserves; the script
    holds the highest cost among the models the key may use. (Not frozen: made on every request, and a frozen
    dataclass' __init__ costs several times as much.)"""

    state_id: str
    key_hash: str
    model: str
    estimated_tokens: int
    request_id: str
    lease_ttl_ms: int
    window_ms: int
    cached_version: int | None = None
    budget_tokens: int = 0
    costs: Sequence[tuple[str, int]] = ()

    def keys_and_args(self) -> tuple[tuple[str, ...], list[EncodableT]]:
        keys = (redis_names.state_record(self.state_id), *_counter_keys(self.state_id))
        version = "" if self.cached_version is None else str(self.cached_version)
        args: list[EncodableT] = [
            self.key_hash,
            self.model,
            clamp_tokens(self.estimated_tokens),
            self.request_id,
            self.lease_ttl_ms,
            self.window_ms,
            version,
            clamp_tokens(self.budget_tokens),
        ]
        for cost_model, micros in self.costs or ((self.model, 0),):
            args += (cost_model, clamp_micros(micros))
        return keys, args


async def admit_request(redis: Target, admit: AdmitArgs, scripts: ScriptSet = DEFAULT_SCRIPTS) -> AdmitReply:
    """One admission (see `AdmitArgs`), registering the script on NOSCRIPT."""
    keys, args = admit.keys_and_args()
    return admit_reply(await scripts.admit(redis, keys, args), scripts)


def admit_command(admit: AdmitArgs, scripts: ScriptSet = DEFAULT_SCRIPTS) -> tuple[EncodableT, ...]:
    """The EVALSHA of `admit_request`, for `CommandPipe.submit` (so that a key's and its team's admissions go out
    in one write); its reply goes to `admit_reply`. A NOSCRIPT reply means: call `admit_request` (it registers)."""
    keys, args = admit.keys_and_args()
    return ("EVALSHA", scripts.admit.sha, len(keys), *keys, *args)


def admit_reply(reply: Any, scripts: ScriptSet = DEFAULT_SCRIPTS) -> AdmitReply:
    """An `admit_request` reply, parsed (a reply we cannot read is a `ScriptError`)."""
    try:
        return _admit_reply(reply)
    except (ValueError, TypeError, IndexError) as exc:
        raise classify_failure(exc, scripts.admit) from exc


async def cancel_admission(
    redis: Target,
    *,
    state_id: str,
    request_id: str,
    reserved_tokens: int,
    budget_tokens: int,
    reserved_micros: int,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> int:
    """Undo an admission of `state_id` (a key's id or a team's state id) for a request that will not run."""
    keys = _counter_keys(state_id)
    hold = f"{request_id}|{clamp_tokens(budget_tokens)}|{clamp_micros(reserved_micros)}"
    return int(await scripts.cancel(redis, keys, (request_id, clamp_tokens(reserved_tokens), hold)))


def _admit_reply(reply: Any) -> AdmitReply:
    flat = [as_text(item) for item in reply[2]]
    return AdmitReply(
        status=as_text(reply[0]),
        version=int(reply[1]),
        record=dict(zip(flat[::2], flat[1::2], strict=True)),
        rpm_limit=int(reply[3]),
        rpm_remaining=int(reply[4]),
        rpm_reset_ms=int(reply[5]),
        tpm_limit=int(reply[6]),
        tpm_remaining=int(reply[7]),
        tpm_reset_ms=int(reply[8]),
        retry_after_ms=int(reply[9]),
        leases_remaining=int(reply[10]),
        budget_spent=int(reply[11]),
        budget_limit=int(reply[12]),
        budget_unit=as_text(reply[13]),
        budget_held=int(reply[14]),
        budget_needed=int(reply[15]),
        reserved_micros=int(reply[16]),
    )


@dataclass(frozen=True, slots=True)
class SettleItem:
    """One finished request of a key: its reservation and what it really used."""

    request_id: str
    reserved_tokens: int
    prompt_tokens: int
    completion_tokens: int
    model: str
    cost_micros: int = 0  # integer micro-units of the price currency
    is_priced: bool = False  # False: the model has no price configured, so it cost 0
    budget_tokens: int = 0  # the budget hold taken at admission (tokens, micros): removed by the settle
    reserved_micros: int = 0
    is_estimated: bool = False  # the upstream reported no counts (e.g. a stream cut before its usage chunk)


def _settle_keys_and_args(
    key_id: str, items: Sequence[SettleItem], window_ms: int, marker_ttl_ms: int, usage_retention_s: int
) -> tuple[list[str], list[EncodableT]]:
    keys = [
        redis_names.state_record(key_id),
        redis_names.key_tpm_log(key_id),
        redis_names.key_tpm_sum(key_id),
        redis_names.key_leases(key_id),
        redis_names.key_usage_total(key_id),
        redis_names.key_usage_days(key_id),
        redis_names.key_holds(key_id),
        redis_names.key_holds_sum(key_id),
    ]
    args: list[EncodableT] = [redis_names.key_prefix(key_id), window_ms, marker_ttl_ms, usage_retention_s]
    for item in items:
        keys.append(redis_names.key_settled(key_id, item.request_id))
        args += (
            item.request_id,
            clamp_tokens(item.reserved_tokens),
            clamp_tokens(item.prompt_tokens),
            clamp_tokens(item.completion_tokens),
            item.model,
            clamp_micros(item.cost_micros),
            1 if item.is_priced else 0,
            f"{item.request_id}|{clamp_tokens(item.budget_tokens)}|{clamp_micros(item.reserved_micros)}",
            1 if item.is_estimated else 0,
        )
    return keys, args


def settle_command(
    *,
    key_id: str,
    items: Sequence[SettleItem],
    window_ms: int,
    marker_ttl_ms: int,
    usage_retention_s: int,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> tuple[EncodableT, ...]:
    """The EVALSHA that settles a batch of one key's requests (for `CommandPipe.submit`); its reply goes to
    `settled_flags`. A NOSCRIPT reply means: call `settle_requests` with the same items (it registers the script)."""
    keys, args = _settle_keys_and_args(key_id, items, window_ms, marker_ttl_ms, usage_retention_s)
    return ("EVALSHA", scripts.settle.sha, len(keys), *keys, *args)


def settled_flags(reply: Any, scripts: ScriptSet = DEFAULT_SCRIPTS) -> list[bool]:
    """Per request of a settle batch: whether this call settled it (False: it had been settled before)."""
    try:
        return [bool(int(flag)) for flag in reply]
    except (ValueError, TypeError) as exc:
        raise classify_failure(exc, scripts.settle) from exc


async def settle_requests(
    redis: Target,
    *,
    key_id: str,
    items: Sequence[SettleItem],
    window_ms: int,
    marker_ttl_ms: int,
    usage_retention_s: int,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> list[bool]:
    """Settle a batch of one key's requests in one script call (registering the script when Redis lost it)."""
    keys, args = _settle_keys_and_args(key_id, items, window_ms, marker_ttl_ms, usage_retention_s)
    return settled_flags(await scripts.settle(redis, keys, args), scripts)


_UPSTREAM_CLASSES = ("high", "normal", "low")  # the priority classes of upstream waiters, served in this order


def _upstream_keys(deployment: str, priority: str, tenant: str) -> tuple[str, ...]:
    return (
        redis_names.upstream_leases(deployment),
        redis_names.upstream_queue(deployment),
        redis_names.upstream_max(deployment),
        *(redis_names.upstream_tenants(deployment, name) for name in _UPSTREAM_CLASSES),
        redis_names.upstream_line(deployment, priority, tenant),
    )


async def acquire_upstream(
    redis: Target,
    *,
    deployment: str,
    lease_id: str,
    max_in_flight: int,
    lease_ttl_ms: int,
    wait_timeout_ms: int,
    queue_entry: str,
    handoff_ttl_ms: int,
    tenant: str = "",
    weight: float = 1.0,
    priority: str = "normal",
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> tuple[bool, str]:
    """(is_held, queue entry to pass back on the next call or on giving up). Waiters are served by `priority`
    class (high, normal, low), then by the tenant's hand-offs / `weight`, FIFO within a tenant."""
    args = (
        lease_id,
        max_in_flight,
        lease_ttl_ms,
        wait_timeout_ms,
        queue_entry,
        redis_names.upstream_prefix(deployment),
        priority,
        tenant,
        repr(float(weight)),
        handoff_ttl_ms,
    )
    reply = await scripts.acquire(redis, _upstream_keys(deployment, priority, tenant), args)
    try:
        return bool(int(reply[0])), as_text(reply[1])
    except (ValueError, TypeError, IndexError) as exc:
        raise classify_failure(exc, scripts.acquire) from exc


async def release_upstream(
    redis: Target,
    *,
    deployment: str,
    lease_id: str,
    queue_entry: str,
    handoff_ttl_ms: int,
    tenant: str = "",
    priority: str = "normal",
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> int:
    """Free the lease (and/or leave the `tenant`'s line in `priority`); returns how many waiters were handed a
    slot."""
    args = (lease_id, queue_entry, redis_names.upstream_prefix(deployment), handoff_ttl_ms, priority, tenant)
    return int(await scripts.release(redis, _upstream_keys(deployment, priority, tenant), args))


async def update_key(
    redis: Target, *, key_id: str, fields: dict[str, str], scripts: ScriptSet = DEFAULT_SCRIPTS
) -> int:
    """Set `fields` on an existing record and bump its version; 0 when there is no such record."""
    args = [redis_names.key_prefix(key_id), *(item for pair in fields.items() for item in pair)]
    return int(await scripts.update(redis, (redis_names.key_record(key_id),), args))


async def update_team(
    redis: Target, *, team_id: str, fields: dict[str, str], scripts: ScriptSet = DEFAULT_SCRIPTS
) -> int:
    """`update_key` on a team's record (the same period recount from the team's own usage day hashes)."""
    args = [redis_names.team_prefix(team_id), *(item for pair in fields.items() for item in pair)]
    return int(await scripts.update(redis, (redis_names.team_record(team_id),), args))
