"""`RedisAccess`: the `AccessControl` of a gateway with keys, limits and budgets in Redis. Its `upstream_limiter`
(a `RedisUpstreamLimiter`, auth/upstream.py) is the `UpstreamLimiter` on the same connection and failure handling.

Hot path: `admit` is one Redis round trip (the `admit_request` script) once the key's id is cached; a key seen
for the first time costs one extra GET (hash → id). The script is authoritative — revoked, expired, rotated,
allowlist, budget, concurrency, RPM, TPM — so a revocation takes effect on every instance at once. The
in-process cache holds verified keys for `limits.key_cache_ttl_s`; it serves `authenticate` and carries cached
keys through a Redis outage, and is invalidated through pub/sub (`ug:events`) when an admin changes a key.

When Redis fails (`StorageError`: unreachable, timed out, or refusing for its own state),
`AccessConfig.failure_mode` (`UNIGATE_REDIS_FAILURE_MODE`) decides: `closed` → 503 `limits_unavailable`
except for keys verified within the cache lifetime; `open` → serve every key this instance has verified before,
without limits (an unknown key still cannot be verified, so it still gets 503). Every bypass is logged and
counted. Nothing waits on a dead Redis for longer than the client's socket timeout, and after one failure the
next `_FAST_FAIL_S` skip Redis entirely. A Redis that answers but not as the store it should be (a read-only
replica, a cluster redirection not followed to its end: `StorageError.is_outage` False) is no outage: 503 for
every key, never a bypass, whatever the failure mode.

On a Redis Cluster the hot path keeps one pipelined connection per node (`auth/cluster_pipe.py`), following MOVED
and ASK; on Sentinel the client follows the primary (`auth/redis_sentinel.py`).

A script that raises (`ScriptError`) is a bug of ours, not an outage: it is logged once per script and line,
counted per script (`num_script_errors`), and never opens the fast-fail window or bypasses a limit. An admission
or upstream lease that hits one answers 500 `internal_error`; a settle that hits one is lost (and counted) while
the response goes out normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from redis.exceptions import NoScriptError, RedisError
from redis.typing import EncodableT

from auth import redis_names, scripts
from auth.base import KEY_PREFIX, Admission, Principal, SettleUsage, model_allowed, wrong_prefix_error
from auth.cluster_pipe import make_pipe
from auth.keys import hash_key, new_request_id
from auth.redis_client import RedisClient, disconnect_idle, is_writable, subscribe
from auth.scripts import DEFAULT_SCRIPTS, AdmitReply, ScriptError, ScriptSet, StorageError
from auth.settle_retry import SettleRetries
from auth.store import KeyRecord, KeyStore
from auth.upstream import RedisUpstreamLimiter, cancel_until_done
from gateway.errors import (
    AuthError,
    BudgetExceededError,
    GatewayError,
    LimitError,
    PermissionDeniedError,
    UnavailableError,
)

__all__ = ["AccessConfig", "RedisAccess", "format_reset"]

logger = logging.getLogger("unigate.auth")


_FAST_FAIL_S = 0.5  # after a failure, skip Redis this long instead of paying a timeout on every request
_MAX_CACHED_KEYS = 10_000
_MARKER_TTL_MS = 120_000  # a retried settle within 2 min is a no-op (one small key per request, so keep it short)
_USAGE_RETENTION_S = 400 * 86_400
_MAX_SETTLE_BATCH = 128  # requests per settle script call (it runs atomically, so keep each call short)


def format_reset(ms: int) -> str:
    """OpenAI's duration style for x-ratelimit-reset-*: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def _retry_after(ms: int) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(ms / 1000)))}


class _FastFailError(StorageError):
    """Redis was not asked: it failed less than `_FAST_FAIL_S` ago."""


@dataclass(slots=True)
class _CachedKey:
    key_id: str
    version: int
    principal: Principal
    expires_at_ms: int | None
    is_revoked: bool
    verified_at: float  # monotonic time of the last verification against Redis
    # A budget or a TPM limit: the next admission (on any instance) reads what this key's settles write.
    reads_its_settles: bool = False

    def check(self) -> None:
        """Raise if the cached record itself says no (used when Redis cannot be asked)."""
        if self.is_revoked:
            raise _revoked_error()
        if self.expires_at_ms is not None and self.expires_at_ms <= time.time() * 1000:
            raise _expired_error()


@dataclass(slots=True)
class _SettleBatch:
    """Settles of one key queued on the command pipe as one script call, open to more until it is written."""

    key_id: str
    items: list[scripts.SettleItem] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # the gateway's request ids, for logs
    futures: list[asyncio.Future[None]] = field(default_factory=list)


def _revoked_error() -> AuthError:
    return AuthError("This API key has been revoked. Ask the gateway admin for a new key.", code="key_revoked")


def _expired_error() -> AuthError:
    return AuthError(
        "This API key has expired. Ask the gateway admin to extend it (PATCH expires_at) or for a new key.",
        code="key_expired",
    )


def _unknown_key_error() -> AuthError:
    return AuthError(
        "Invalid API key: no such key (or it was rotated). Check for typos or create one with `unigate keys create`."
    )


def _headers(reply: AdmitReply) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers. A remaining count the script did not get to (-1 on a rejection by an
    earlier check) is left out with its reset rather than reported as 0."""
    headers: dict[str, str] = {}
    if reply.rpm_limit >= 0:
        headers["x-ratelimit-limit-requests"] = str(reply.rpm_limit)
        if reply.rpm_remaining >= 0:
            headers["x-ratelimit-remaining-requests"] = str(reply.rpm_remaining)
            headers["x-ratelimit-reset-requests"] = format_reset(reply.rpm_reset_ms)
    if reply.tpm_limit >= 0:
        headers["x-ratelimit-limit-tokens"] = str(reply.tpm_limit)
        if reply.tpm_remaining >= 0:
            headers["x-ratelimit-remaining-tokens"] = str(reply.tpm_remaining)
            headers["x-ratelimit-reset-tokens"] = format_reset(reply.tpm_reset_ms)
    return headers


def _rejection(reply: AdmitReply, principal: Principal | None, model: str, estimated_tokens: int) -> GatewayError:
    status, retry_ms = reply.status, reply.retry_after_ms
    if status == "key_revoked":
        return _revoked_error()
    if status == "key_expired":
        return _expired_error()
    if status == "model_not_allowed":
        allowed = ", ".join(principal.models) if principal is not None else "(see the key's settings)"
        return PermissionDeniedError(
            f"This API key may not use model '{model}'. Allowed models: {allowed}. Ask the gateway admin to add it.",
            code="model_not_allowed",
            param="model",
        )
    if status == "budget_exceeded":
        if reply.budget_unit == "micros":
            spent = f"${reply.budget_spent / 1e6:,.6f}".rstrip("0").rstrip(".")
            limit = f"${reply.budget_limit / 1e6:,.6f}".rstrip("0").rstrip(".")
            what, field_name = f"spend budget is used up: {spent} spent of {limit}", "budget_usd"
        else:
            what = f"token budget is used up: {reply.budget_spent} tokens spent of {reply.budget_limit}"
            field_name = "token_budget"
        period = " in this budget period" if retry_ms else ""
        return BudgetExceededError(
            f"This API key's {what}{period}. Ask the gateway admin to raise `{field_name}`"
            + (" or wait for the budget period to reset." if retry_ms else "."),
            headers=_retry_after(retry_ms) if retry_ms else {},
        )
    if status == "concurrency_limit_exceeded":
        return LimitError(
            "Too many concurrent requests for this API key (max_concurrent). Wait for one to finish and retry.",
            code="concurrency_limit_exceeded",
            headers=_retry_after(retry_ms),
        )
    headers = {**_retry_after(retry_ms), **_headers(reply)}
    if status == "rate_limit_exceeded":
        return LimitError(
            f"Rate limit reached: {reply.rpm_limit} requests per minute for this API key. "
            f"Retry after {headers['retry-after']} s.",
            code="rate_limit_exceeded",
            headers=headers,
        )
    if status == "tokens_limit_exceeded":
        if estimated_tokens > reply.tpm_limit:
            # Waiting never helps: no retry hint (the headers still say what is left in the window).
            return LimitError(
                f"This request may use up to {estimated_tokens} tokens, more than this key's whole limit of "
                f"{reply.tpm_limit} tokens per minute, so it can never fit. Lower max_tokens or shorten the prompt.",
                code="tokens_limit_exceeded",
                headers=_headers(reply),
            )
        else:
            message = (
                f"Token rate limit reached: {reply.tpm_limit} tokens per minute for this API key. "
                f"Retry after {headers['retry-after']} s, or lower max_tokens."
            )
        return LimitError(message, code="tokens_limit_exceeded", headers=headers)
    return _unknown_key_error()


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """What `RedisAccess` needs of the gateway's settings, passed in by the composition root (gateway/server.py)."""

    failure_mode: Literal["closed", "open"] = "closed"  # UNIGATE_REDIS_FAILURE_MODE
    key_cache_ttl_s: float = 5.0  # limits.key_cache_ttl_s
    lease_ttl_s: float = 600.0  # limits.lease_ttl_s


class RedisAccess:
    """`AccessControl` over Redis. Call `start()` once (the lifespan does) and `aclose()` at shutdown."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        config: AccessConfig,
        master_key: str,
        rate_window_s: float = 60.0,
        script_set: ScriptSet = DEFAULT_SCRIPTS,
    ) -> None:
        """`rate_window_s` is the RPM/TPM window: 60 s in production; tests shorten it to cross its edge, or pass
        a `script_set` with a test clock to move time instead."""
        self._redis = redis
        self._scripts = script_set
        self._store = KeyStore(redis, scripts=script_set)
        self._pipe = make_pipe(redis)  # admit / settle / upstream leases, auto-pipelined (one per cluster node)
        self._master_key = master_key.encode()
        self._master = Principal(key_id=None, name="master", is_master=True)
        self._is_fail_open = config.failure_mode == "open"
        self._cache_ttl_s = config.key_cache_ttl_s
        self._lease_ttl_ms = int(config.lease_ttl_s * 1000)
        self._window_ms = int(rate_window_s * 1000)
        self._cache: dict[str, _CachedKey] = {}
        self._redis_down_until = 0.0
        self._is_down_an_outage = True  # what the last failure was (see `StorageError.is_outage`)
        self._listener: asyncio.Task[None] | None = None
        self._open_settles: dict[str, _SettleBatch] = {}
        self._settling: set[asyncio.Task[None]] = set()
        # Settles Redis could not take, sent again once it answers (their leases would otherwise be held to TTL).
        self._retries = SettleRetries(self._resend_settles, is_down=lambda: time.monotonic() < self._redis_down_until)
        self._is_closing = False
        # Counters for the app's metrics registry (gateway/metrics exports them; no global registry here).
        self.num_storage_errors = 0
        self.num_limit_bypasses = 0
        self.num_script_errors: dict[str, int] = {}  # per script name
        self._logged_script_errors: set[tuple[str, int]] = set()
        # The `UpstreamLimiter` on the same connection, failure handling and counters; closed by `aclose()`.
        self.upstream_limiter = RedisUpstreamLimiter(
            redis, self._pipe, failures=self, lease_ttl_ms=self._lease_ttl_ms, script_set=script_set
        )

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the scripts (best effort: NOSCRIPT recovery covers a Redis that is down now) and start
        listening for key changes."""
        try:
            await scripts.register_all(self._redis, self._scripts)
        except StorageError as exc:
            await self.note_failure("register_scripts", exc)
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="unigate-key-events")

    async def aclose(self) -> None:
        if self._settling:  # settles already queued are sent, not dropped (each is bounded by the socket timeout)
            await asyncio.wait(set(self._settling), timeout=5.0)
        await self._retries.aclose()
        self._is_closing = True  # the listener also checks it at least once a second
        if self._listener is not None:
            await cancel_until_done({self._listener}, timeout_s=3.0)
        self._listener = None
        await self.upstream_limiter.aclose()
        await self._pipe.aclose()

    async def ping(self) -> bool:
        """For /health/ready: can Redis be written right now (every primary of a cluster)? A read-only replica, a
        cluster that is down and a Sentinel failover in progress all say no."""
        return await is_writable(self._redis)

    async def _listen(self) -> None:
        """Drop cached keys on `ug:events`; after any gap in the subscription drop them all (events were missed)."""
        backoff_s = 0.1
        has_subscribed = False
        while not self._is_closing:
            pubsub = None
            try:
                pubsub = await subscribe(self._redis, redis_names.EVENTS_CHANNEL)
                if has_subscribed:
                    self._cache.clear()
                has_subscribed = True
                backoff_s = 0.1
                while not self._is_closing:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None:
                        self._invalidate(message["data"].decode())
            except (TimeoutError, RedisError, OSError):
                pass
            finally:
                if pubsub is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)

    # -- the key cache -----------------------------------------------------------------------------------------

    def _invalidate(self, key_id: str) -> None:
        for key_hash in [h for h, cached in self._cache.items() if cached.key_id == key_id]:
            del self._cache[key_hash]

    def _remember(self, key_hash: str, record: KeyRecord) -> _CachedKey:
        cached = _CachedKey(
            key_id=record.id,
            version=record.version,
            principal=Principal(key_id=record.id, name=record.name, models=record.models),
            expires_at_ms=record.expires_at_ms,
            is_revoked=record.is_revoked,
            verified_at=time.monotonic(),
            reads_its_settles=any(
                limit is not None and limit >= 0 for limit in (record.tpm, record.token_budget, record.budget_micros)
            ),
        )
        self._cache.pop(key_hash, None)
        if len(self._cache) >= _MAX_CACHED_KEYS:
            del self._cache[next(iter(self._cache))]
        self._cache[key_hash] = cached
        return cached

    def _is_fresh(self, cached: _CachedKey) -> bool:
        return time.monotonic() - cached.verified_at < self._cache_ttl_s

    # -- Redis failure handling (also the `StorageFailures` of `self.upstream_limiter`) -------------------------

    async def note_failure(self, operation: str, exc: StorageError) -> None:
        """Count and log a failure, fail fast for a moment, and drop idle pooled connections: after a Redis restart
        each of them would fail once more, so recovery would be slow and ragged without this."""
        if isinstance(exc, _FastFailError):
            return  # not a new failure: Redis was not asked
        self.num_storage_errors += 1
        self._is_down_an_outage = exc.is_outage
        if time.monotonic() >= self._redis_down_until:
            logger.warning(
                "Redis unavailable during %s; failure mode %s", operation, "open" if self._is_fail_open else "closed"
            )
        self._redis_down_until = time.monotonic() + _FAST_FAIL_S
        await disconnect_idle(self._redis)
        await self.upstream_limiter.disconnect()
        await self._pipe.disconnect()

    def note_script_error(self, error: ScriptError, request_id: str) -> None:
        """Count a script error and log it the first time its script and line fail (the detail names both)."""
        self.num_script_errors[error.script] = self.num_script_errors.get(error.script, 0) + 1
        where = (error.script, error.line)
        if where not in self._logged_script_errors:
            self._logged_script_errors.add(where)
            logger.error(
                "Lua script %s failed at line %d (request %s): %s", error.script, error.line, request_id, error.detail
            )

    def check_redis_up(self) -> None:
        if time.monotonic() < self._redis_down_until:
            error = _FastFailError("Redis failed moments ago; not retrying yet.", headers={"retry-after": "1"})
            error.is_outage = self._is_down_an_outage
            raise error

    def note_bypass(self) -> None:
        self.num_limit_bypasses += 1

    def _without_redis(self, cached: _CachedKey | None, model: str | None, failure: StorageError) -> Principal:
        """The principal to serve without Redis, or 503 `limits_unavailable` when the failure mode forbids it or
        Redis did not fail at all (a redirection or a read-only replica answered: see `StorageError.is_outage`)."""
        if failure.is_outage and cached is not None and (self._is_fail_open or self._is_fresh(cached)):
            cached.check()
            if model is not None and not model_allowed(cached.principal.models, model):
                raise PermissionDeniedError(
                    f"This API key may not use model '{model}'. Ask the gateway admin to add it.",
                    code="model_not_allowed",
                    param="model",
                )
            self.num_limit_bypasses += 1
            return cached.principal
        raise UnavailableError(
            "Rate limits cannot be checked right now (the gateway's Redis is unavailable), so this key cannot be "
            "verified. Retry in a few seconds.",
            code="limits_unavailable",
            headers={"retry-after": "1"},
        )

    # -- AccessControl -----------------------------------------------------------------------------------------

    def _is_master(self, credential: str) -> bool:
        return hmac.compare_digest(credential.encode(), self._master_key)

    async def authenticate(self, credential: str) -> Principal:
        if self._is_master(credential):
            return self._master
        if not credential.startswith(KEY_PREFIX):
            raise wrong_prefix_error()
        key_hash = hash_key(credential)
        cached = self._cache.get(key_hash)
        if cached is not None and self._is_fresh(cached):
            cached.check()
            return cached.principal
        try:
            self.check_redis_up()
            record = await self._store.find_by_secret(credential)
        except StorageError as exc:
            await self.note_failure("authenticate", exc)
            return self._without_redis(cached, None, exc)
        if record is None:
            self._cache.pop(key_hash, None)
            raise _unknown_key_error()
        cached = self._remember(key_hash, record)
        cached.check()
        return cached.principal

    async def admit(self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "") -> Admission:
        if self._is_master(credential):
            return Admission(principal=self._master, model=model, settles_late=True, request_id=request_id)
        if not credential.startswith(KEY_PREFIX):
            raise wrong_prefix_error()
        key_hash = hash_key(credential)
        cached = self._cache.get(key_hash)
        lease_id = new_request_id()
        try:
            self.check_redis_up()
            key_id = cached.key_id if cached is not None else await self._store.find_id(key_hash)
            if key_id is None:
                raise _unknown_key_error()
            reply = await scripts.admit_request(
                self._pipe,
                key_id=key_id,
                key_hash=key_hash,
                model=model,
                estimated_tokens=estimated_tokens,
                request_id=lease_id,
                lease_ttl_ms=self._lease_ttl_ms,
                window_ms=self._window_ms,
                cached_version=cached.version if cached is not None else None,
                scripts=self._scripts,
            )
        except ScriptError as error:
            self.note_script_error(error, request_id)
            raise
        except StorageError as exc:
            await self.note_failure("admit", exc)
            principal = self._without_redis(cached, model, exc)
            return Admission(
                principal=principal, model=model, lease_id=lease_id, settles_late=True, request_id=request_id
            )
        if reply.record:
            cached = self._remember(key_hash, KeyRecord.from_hash(reply.record))
        if reply.status == "invalid_api_key":
            self._cache.pop(key_hash, None)
        if reply.status != "ok" or cached is None:
            raise _rejection(reply, cached.principal if cached is not None else None, model, estimated_tokens)
        cached.verified_at = time.monotonic()
        return Admission(
            principal=cached.principal,
            model=model,
            reserved_tokens=scripts.clamp_tokens(estimated_tokens),
            lease_id=lease_id,
            headers=_headers(reply),
            # See Admission.settles_late: a budget or TPM check reads the charge, the last free slot its lease.
            settles_late=reply.leases_remaining != 0 and not cached.reads_its_settles,
            request_id=request_id,
        )

    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        """True up the reservation, release the concurrency lease and record usage and spend; queued on the
        command pipe before this returns. Never fails for Redis failures: the reservation then ages out of the
        window and the lease expires.

        The settles of one key queued before the pipe writes its next batch share one script call, so the record
        and usage updates cost Redis once per batch (at c=32 on one key that halved Redis' time per request)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if admission.is_settled:
            future.set_result(None)
            return future
        admission.is_settled = True
        key_id = admission.principal.key_id or redis_names.MASTER_ID
        item = scripts.SettleItem(
            request_id=admission.lease_id or new_request_id(),
            reserved_tokens=admission.reserved_tokens,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            model=admission.model,
            cost_micros=usage.cost_micros,
            is_priced=usage.is_priced,
        )
        if time.monotonic() < self._redis_down_until:  # known down: keep it for when Redis answers again
            self._retries.keep(key_id, [item])
            future.set_result(None)
            return future
        batch = self._open_settles.get(key_id)
        if batch is None or len(batch.items) >= _MAX_SETTLE_BATCH:
            self._open_settles[key_id] = batch = _SettleBatch(key_id)
            build = functools.partial(self._settle_command, batch)
            reply = self._pipe.submit(build, key=redis_names.key_record(key_id))
            task = asyncio.ensure_future(self._finish_settles(batch, reply))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
        batch.items.append(item)
        batch.request_ids.append(admission.request_id)
        batch.futures.append(future)
        return future

    async def settle(self, admission: Admission, usage: SettleUsage) -> None:
        await self.begin_settle(admission, usage)

    def _close_batch(self, batch: _SettleBatch) -> None:
        if self._open_settles.get(batch.key_id) is batch:
            del self._open_settles[batch.key_id]

    def _settle_command(self, batch: _SettleBatch) -> tuple[EncodableT, ...]:
        """Called by the pipe as it writes the batch: later settles start a new one."""
        self._close_batch(batch)
        return scripts.settle_command(
            key_id=batch.key_id,
            items=batch.items,
            window_ms=self._window_ms,
            marker_ttl_ms=_MARKER_TTL_MS,
            usage_retention_s=_USAGE_RETENTION_S,
            scripts=self._scripts,
        )

    async def _finish_settles(self, batch: _SettleBatch, reply: asyncio.Future[Any]) -> None:
        try:
            try:
                try:
                    scripts.settled_flags(await reply, self._scripts)
                except NoScriptError:  # Redis restarted or was flushed: register and send the batch again
                    await self._settle_now(batch.key_id, batch.items)
                except (TimeoutError, RedisError, OSError) as exc:
                    raise scripts.classify_failure(exc, self._scripts.settle) from exc
            except ScriptError as error:
                self.note_script_error(error, ",".join(filter(None, batch.request_ids)) or batch.key_id)
            except StorageError as exc:
                await self.note_failure("settle", exc)
                self._retries.keep(batch.key_id, batch.items)
        finally:
            self._close_batch(batch)  # the pipe failed before writing it: nothing more may join
            for future in batch.futures:
                if not future.done():
                    future.set_result(None)

    async def _resend_settles(self, key_id: str, items: list[scripts.SettleItem]) -> None:
        """Send settles kept by `SettleRetries` (idempotent: one that did reach Redis changes nothing); raises
        `StorageError` while Redis is still unavailable. A script error drops them, counted like any other."""
        for start in range(0, len(items), _MAX_SETTLE_BATCH):
            try:
                try:
                    await self._settle_now(key_id, items[start : start + _MAX_SETTLE_BATCH])
                except (TimeoutError, RedisError, OSError) as exc:
                    raise scripts.classify_failure(exc, self._scripts.settle) from exc
            except ScriptError as error:
                self.note_script_error(error, key_id)
            except StorageError as exc:
                await self.note_failure("settle", exc)
                raise

    async def _settle_now(self, key_id: str, items: Sequence[scripts.SettleItem]) -> None:
        """One script call settling `items` of one key, outside the batching pipe's queue."""
        await scripts.settle_requests(
            self._pipe,
            key_id=key_id,
            items=items,
            window_ms=self._window_ms,
            marker_ttl_ms=_MARKER_TTL_MS,
            usage_retention_s=_USAGE_RETENTION_S,
            scripts=self._scripts,
        )
