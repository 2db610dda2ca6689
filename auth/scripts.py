"""The Lua scripts under auth/lua/, each behind one typed wrapper.

Scripts are read from the package (shipped as package data), registered once with SCRIPT LOAD, and called by
SHA; a Redis that restarted or was flushed answers NOSCRIPT, and the call registers the script again and retries
once.

Failures leave this module as one of two types, and the difference matters:
- `StorageError`: Redis could not be reached, timed out, or refused for a server-side state (read-only replica,
  out of memory, loading, busy, cluster down). Callers may fall back on their failure mode.
- `ScriptError`: a script of ours raised (a Lua runtime error) or answered something we cannot parse. That is a
  bug, never an outage: callers must not skip a limit or enter a "Redis is down" state for it.

The time every script reads (`now_ms()`) is Redis' TIME. `ScriptSet(clock_key=...)` builds the same scripts with
a clock read from a Redis string key instead, for tests that move time across minutes, days and months.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError, NoScriptError, RedisError, ResponseError
from redis.typing import EncodableT

from auth import redis_names
from gateway.errors import GatewayError, UnavailableError

__all__ = [
    "DEFAULT_SCRIPTS",
    "MAX_TOKENS",
    "AdmitReply",
    "CommandPipe",
    "LuaScript",
    "ScriptError",
    "ScriptSet",
    "SettleItem",
    "StorageError",
    "acquire_upstream",
    "admit_request",
    "as_text",
    "classify_failure",
    "register_all",
    "release_upstream",
    "settle_command",
    "settle_requests",
    "settled_flags",
    "storage_errors",
    "update_key",
]


class StorageError(UnavailableError):
    """Redis could not be reached or answered with an error (never carries the server address)."""

    code = "storage_unavailable"


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
    r"(?:^|-)(?:READONLY|OOM|MISCONF|NOREPLICAS|MASTERDOWN|LOADING|BUSY|CLUSTERDOWN|TRYAGAIN|MOVED|ASK|NOPERM)\b"
)


def classify_failure(exc: BaseException, script: LuaScript) -> StorageError | ScriptError:
    """A failed script call as an outage (`StorageError`) or a bug of ours (`ScriptError`)."""
    if isinstance(exc, ResponseError) and not _SERVER_STATE.search(str(exc)):
        return ScriptError(script.name, str(exc), line_offset=script.num_prelude_lines)
    if isinstance(exc, ValueError | TypeError | IndexError | KeyError | AttributeError):
        return ScriptError(script.name, f"unreadable reply ({type(exc).__name__}: {exc})")
    return _storage_error(exc)


def _storage_error(exc: BaseException) -> StorageError:
    return StorageError(
        f"The key store (Redis) is unavailable ({type(exc).__name__}). Retry shortly; if it persists, check "
        "that Redis is running and reachable from the gateway.",
        headers={"retry-after": "1"},
    )


@asynccontextmanager
async def storage_errors() -> AsyncIterator[None]:
    """Translate every Redis/socket failure inside the block into `StorageError`."""
    try:
        yield
    except _STORAGE_FAILURES as exc:
        raise _storage_error(exc) from exc


_MAX_WRITE_BUFFER = 64 * 1024  # wait for the socket to drain only past this many unsent bytes


def encode_command(args: tuple[EncodableT, ...]) -> bytes:
    """One command in RESP. redis-py's `pack_command` spent ~10% of the gateway's CPU on the two Lua calls of a
    request (memoryview chunking, per-argument checks); the arguments here are short ids and numbers."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int) and not isinstance(arg, bool):
            data = b"%d" % arg
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:  # the same refusal as redis-py's encoder (None, bool, other objects)
            raise DataError(f"Invalid input of type {type(arg).__name__} for a Redis command")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


_Args = Callable[[], tuple[EncodableT, ...]]  # a queued command's arguments, built when its batch is written


class CommandPipe:
    """Commands of the hot path over ONE dedicated connection, auto-pipelined: every command issued while a batch
    is on the wire is sent with the next batch in one write, and the replies are read back in order.

    Why: with the shared pool each script call paid a pool checkout (lock, condition, readiness probe), a write
    wrapped in a timeout task and a read, per command; under concurrency the gateway spent about a quarter of its
    CPU there. One connection in FIFO order also means a command issued after another is executed after it.

    A connection failure or timeout fails every command of the batch (callers see `RedisError`/`OSError`, as from
    the client); the next batch reconnects. An error reply (e.g. NOSCRIPT) fails only its own command.
    """

    def __init__(self, redis: Redis) -> None:
        pool = redis.connection_pool
        self._connection: AbstractConnection = pool.connection_class(**pool.connection_kwargs)
        self._timeout_s: float | None = pool.connection_kwargs.get("socket_timeout")
        self._queue: list[tuple[_Args, asyncio.Future[Any]]] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._is_closing = False

    async def execute(self, *args: EncodableT) -> Any:
        return await self.submit(lambda: args)

    def submit(self, build_args: Callable[[], tuple[EncodableT, ...]]) -> asyncio.Future[Any]:
        """Queue a command now, in FIFO order with every other command, whose arguments are built only when its
        batch is written: until then the caller may still add to it (the settles of one key share one call)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((build_args, future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run(), name="unigate-redis-pipe")
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)
        return future

    async def evalsha(self, sha: str, num_keys: int, *keys_and_args: EncodableT) -> Any:
        return await self.execute("EVALSHA", sha, num_keys, *keys_and_args)

    async def script_load(self, source: str) -> Any:
        return await self.execute("SCRIPT", "LOAD", source)

    async def disconnect(self) -> None:
        """Drop the connection (after a failure elsewhere: it would fail once more); the next batch reconnects."""
        if not self._queue and (self._worker is None or self._worker.done()):
            with contextlib.suppress(RedisError, OSError):
                await self._connection.disconnect(nowait=True)

    async def aclose(self) -> None:
        """Finish what was queued, then stop the worker and close the connection."""
        self._is_closing = True
        worker, self._worker = self._worker, None
        if worker is not None:
            if self._wakeup is not None and not self._wakeup.done():
                self._wakeup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker
        with contextlib.suppress(RedisError, OSError):
            await self._connection.disconnect(nowait=True)

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:
            queued, self._queue = self._queue, []
            for _, future in queued:
                if not future.done():
                    future.set_exception(RedisError("the Redis command pipe was closed"))

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if self._is_closing:  # a late command after aclose() was served: close again
                    with contextlib.suppress(RedisError, OSError):
                        await self._connection.disconnect(nowait=True)
                    return
                self._wakeup = loop.create_future()
                try:
                    await self._wakeup
                except asyncio.CancelledError:
                    if self._queue:
                        continue  # closing: serve what is still queued first
                    return
            batch, self._queue = self._queue, []
            try:
                await self._send(batch)
                await self._read_replies(batch)
            except BaseException as exc:
                await self._connection.disconnect(nowait=True)
                failure = exc if isinstance(exc, Exception) else RedisError("the Redis command pipe was closed")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(failure)
                if not isinstance(exc, Exception):
                    raise

    async def _read_replies(self, batch: list[tuple[_Args, asyncio.Future[Any]]]) -> None:
        # One deadline for the whole batch instead of redis-py's timeout context around every reply.
        async with asyncio.timeout(self._timeout_s):
            for _, future in batch:
                try:
                    reply = await self._connection.read_response(timeout=math.inf)
                except ResponseError as error:  # an error reply: only this command failed
                    if not future.done():
                        future.set_exception(error)
                else:
                    if not future.done():
                        future.set_result(reply)

    async def _send(self, batch: list[tuple[_Args, asyncio.Future[Any]]]) -> None:
        connection = self._connection
        if not connection.is_connected:
            await connection.connect()  # type: ignore[no-untyped-call]
        writer = connection._writer  # one write for the batch, without redis-py's per-call timeout task
        assert writer is not None
        writer.write(b"".join([encode_command(build_args()) for build_args, _ in batch]))
        if writer.transport.get_write_buffer_size() > _MAX_WRITE_BUFFER:
            async with asyncio.timeout(self._timeout_s):
                await writer.drain()


_LUA_DIR = Path(__file__).parent / "lua"  # shipped as package data (pyproject: auth = ["lua/*.lua"])


def _read_lua(name: str) -> str:
    return (_LUA_DIR / name).read_text(encoding="utf-8")


def _test_clock(clock_key: str) -> str:
    # Reads a key the script does not declare in KEYS: fine on a standalone test server, never used in production.
    return f"local function now_ms() return tonumber(redis.call('GET', '{clock_key}')) end"


class LuaScript:
    """One script: its source (clock + calendar prelude + the file), its SHA, and NOSCRIPT recovery."""

    def __init__(self, name: str, *, clock_key: str | None = None) -> None:
        self.name = name
        clock = _read_lua("_clock.lua") if clock_key is None else _test_clock(clock_key)
        prelude = clock + "\n" + _read_lua("_calendar.lua")
        self.num_prelude_lines = prelude.count("\n") + 1
        self.source = prelude + "\n" + _read_lua(f"{name}.lua")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def register(self, redis: Redis | CommandPipe) -> None:
        async with storage_errors():
            await redis.script_load(self.source)

    async def __call__(self, redis: Redis | CommandPipe, keys: Sequence[str], args: Sequence[EncodableT]) -> Any:
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
        self.acquire = LuaScript("acquire_upstream", clock_key=clock_key)
        self.release = LuaScript("release_upstream", clock_key=clock_key)
        self.update = LuaScript("update_key", clock_key=clock_key)

    @property
    def all(self) -> tuple[LuaScript, ...]:
        return (self.admit, self.settle, self.acquire, self.release, self.update)


DEFAULT_SCRIPTS = ScriptSet()


async def register_all(redis: Redis, scripts: ScriptSet = DEFAULT_SCRIPTS) -> None:
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


MAX_TOKENS = 2**40  # any token count sent to a script is clamped to [0, MAX_TOKENS] (a Lua double holds it exactly)


def clamp_tokens(value: int) -> int:
    return min(max(int(value), 0), MAX_TOKENS)


async def admit_request(
    redis: Redis | CommandPipe,
    *,
    key_id: str,
    key_hash: str,
    model: str,
    estimated_tokens: int,
    request_id: str,
    lease_ttl_ms: int,
    window_ms: int,
    cached_version: int | None,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> AdmitReply:
    keys = (
        redis_names.key_record(key_id),
        redis_names.key_rpm_log(key_id),
        redis_names.key_tpm_log(key_id),
        redis_names.key_tpm_sum(key_id),
        redis_names.key_leases(key_id),
    )
    version = "" if cached_version is None else str(cached_version)
    args = (key_hash, model, clamp_tokens(estimated_tokens), request_id, lease_ttl_ms, window_ms, version)
    reply = await scripts.admit(redis, keys, args)
    try:
        return _admit_reply(reply)
    except (ValueError, TypeError, IndexError) as exc:
        raise classify_failure(exc, scripts.admit) from exc


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


def _settle_keys_and_args(
    key_id: str, items: Sequence[SettleItem], window_ms: int, marker_ttl_ms: int, usage_retention_s: int
) -> tuple[list[str], list[EncodableT]]:
    keys = [
        redis_names.key_record(key_id),
        redis_names.key_tpm_log(key_id),
        redis_names.key_tpm_sum(key_id),
        redis_names.key_leases(key_id),
        redis_names.key_usage_total(key_id),
        redis_names.key_usage_days(key_id),
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
            min(max(int(item.cost_micros), 0), 2**50),
            1 if item.is_priced else 0,
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
    redis: Redis | CommandPipe,
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


def _upstream_keys(deployment: str) -> tuple[str, str, str]:
    return (
        redis_names.upstream_leases(deployment),
        redis_names.upstream_queue(deployment),
        redis_names.upstream_max(deployment),
    )


async def acquire_upstream(
    redis: Redis | CommandPipe,
    *,
    deployment: str,
    lease_id: str,
    max_in_flight: int,
    lease_ttl_ms: int,
    wait_timeout_ms: int,
    queue_entry: str,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> tuple[bool, str]:
    """(is_held, queue entry to pass back on the next call or on giving up)."""
    args = (lease_id, max_in_flight, lease_ttl_ms, wait_timeout_ms, queue_entry)
    reply = await scripts.acquire(redis, _upstream_keys(deployment), args)
    try:
        return bool(int(reply[0])), as_text(reply[1])
    except (ValueError, TypeError, IndexError) as exc:
        raise classify_failure(exc, scripts.acquire) from exc


async def release_upstream(
    redis: Redis | CommandPipe,
    *,
    deployment: str,
    lease_id: str,
    queue_entry: str,
    handoff_ttl_ms: int,
    scripts: ScriptSet = DEFAULT_SCRIPTS,
) -> int:
    """Free the lease (and/or leave the queue); returns how many waiters were handed a slot."""
    args = (lease_id, queue_entry, redis_names.upstream_prefix(deployment), handoff_ttl_ms)
    return int(await scripts.release(redis, _upstream_keys(deployment), args))


async def update_key(redis: Redis, *, key_id: str, fields: dict[str, str], scripts: ScriptSet = DEFAULT_SCRIPTS) -> int:
    """Set `fields` on an existing record and bump its version; 0 when there is no such record."""
    args = [item for pair in fields.items() for item in pair]
    return int(await scripts.update(redis, (redis_names.key_record(key_id),), args))
