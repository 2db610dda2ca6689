"""`RedisAccess`: the `AccessControl` of a gateway with keys, limits and budgets in Redis, composed of one part per
job on one Redis client and one command pipe:

    KeyCache          auth/key_cache.py       verified keys by hash, dropped on `ug:events` when an admin changes one
    FailurePolicy     auth/failure_policy.py  the failure mode, the fast-fail window, failure counters and logs
    SettleBatcher     auth/settle_batch.py    settles batched per key on the pipe; lost ones resent (settle_retry.py)
    upstream_limiter  auth/upstream.py        the `UpstreamLimiter` on the same connection and failure handling

Hot path: `admit` is one Redis round trip (the `admit_request` script) once the key's id is cached; a key seen
for the first time costs one extra GET (hash → id). The script is authoritative — revoked, expired, rotated,
allowlist, budget, concurrency, RPM, TPM — so a revocation takes effect on every instance at once. The cache
serves `authenticate` for `limits.key_cache_ttl_s` and carries cached keys through a Redis outage, as the
failure policy allows. On a Redis Cluster the hot path keeps one pipelined connection per node
(`auth/cluster_pipe.py`), following MOVED and ASK; on Sentinel the client follows the primary
(`auth/redis_sentinel.py`).

A script error (a bug of ours) on an admission or an upstream lease answers 500 `internal_error`; on a settle the
settle is lost (and counted) while the response goes out normally.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import NoScriptError, RedisError
from redis.typing import EncodableT

from auth import redis_names, scripts
from auth.base import KEY_PREFIX, NO_COST, Admission, BudgetCost, Principal, SettleUsage, wrong_prefix_error
from auth.cluster_pipe import ClusterCommandPipe, make_pipe
from auth.failure_policy import FailurePolicy
from auth.key_cache import CachedKey, CachedTeam, KeyCache
from auth.keys import hash_key, new_request_id
from auth.redis_client import RedisClient, disconnect_idle, is_writable
from auth.rejections import rate_limit_headers, rejection, unknown_key_error
from auth.resp_pipe import CommandPipe
from auth.scripts import DEFAULT_SCRIPTS, ScriptError, ScriptSet, StorageError
from auth.settle_batch import SettleBatcher
from auth.store import KeyRecord, KeyStore
from auth.upstream import RedisUpstreamLimiter

__all__ = ["AccessConfig", "RedisAccess"]


@dataclass(frozen=True, slots=True)
class _Ask:
    """One request's admission, as the key and its team are asked for it (the same request id for both)."""

    model: str
    estimated_tokens: int
    lease_id: str
    budget: BudgetCost


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """What `RedisAccess` needs of the gateway's settings, passed in by the composition root (gateway/server.py)."""

    failure_mode: Literal["closed", "open"] = "closed"  # UNIGATE_REDIS_FAILURE_MODE
    key_cache_ttl_s: float = 5.0  # limits.key_cache_ttl_s
    lease_ttl_s: float = 600.0  # limits.lease_ttl_s


def _headers(reply: scripts.AdmitReply, team_reply: scripts.AdmitReply | None) -> dict[str, str]:
    """The key's x-ratelimit-* headers; the team's for a limit (requests, tokens) the key does not have."""
    headers = rate_limit_headers(reply)
    if team_reply is not None and (
        team_reply.rpm_limit >= 0 > reply.rpm_limit or team_reply.tpm_limit >= 0 > reply.tpm_limit
    ):
        headers = {**rate_limit_headers(team_reply), **headers}
    return headers


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
        self._lease_ttl_ms = int(config.lease_ttl_s * 1000)
        self._window_ms = int(rate_window_s * 1000)
        self._keys = KeyCache(redis, ttl_s=config.key_cache_ttl_s)
        self._failures = FailurePolicy(failure_mode=config.failure_mode, disconnect=self._disconnect_idle)
        self._settles = SettleBatcher(
            self._pipe, failures=self._failures, window_ms=self._window_ms, script_set=script_set
        )
        # The `UpstreamLimiter` on the same connection, failure handling and counters; closed by `aclose()`.
        self.upstream_limiter = RedisUpstreamLimiter(
            redis, self._pipe, failures=self._failures, lease_ttl_ms=self._lease_ttl_ms, script_set=script_set
        )

    @property
    def command_pipe(self) -> CommandPipe | ClusterCommandPipe:
        """The hot path's auto-pipelined connection (one per cluster node), for other writers off the hot path
        (the request log's batches); closed by `aclose()`, so they must be done first."""
        return self._pipe

    # -- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the scripts (best effort: NOSCRIPT recovery covers a Redis that is down now) and start
        listening for key changes."""
        try:
            await scripts.register_all(self._redis, self._scripts)
        except StorageError as exc:
            await self._failures.note_failure("register_scripts", exc)
        self._keys.start()

    async def aclose(self) -> None:
        await self._settles.aclose()
        await self._keys.aclose()
        await self.upstream_limiter.aclose()
        await self._pipe.aclose()

    async def ping(self) -> bool:
        """For /health/ready: can Redis be written right now (every primary of a cluster)? A read-only replica, a
        cluster that is down and a Sentinel failover in progress all say no."""
        return await is_writable(self._redis)

    async def _disconnect_idle(self) -> None:
        """After a failure: drop every idle pooled connection (each would fail once more after a Redis restart)."""
        await disconnect_idle(self._redis)
        await self.upstream_limiter.disconnect()
        await self._pipe.disconnect()

    # -- `AccessStats` (the failure policy's counters) ---------------------------------------------------------

    @property
    def redis(self) -> RedisClient:
        """The connection, for the gateway's other shared state (prefix_affinity's placements)."""
        return self._redis

    @property
    def num_storage_errors(self) -> int:
        return self._failures.num_storage_errors

    @property
    def num_limit_bypasses(self) -> int:
        return self._failures.num_limit_bypasses

    @property
    def num_script_errors(self) -> dict[str, int]:
        return self._failures.num_script_errors

    # -- AccessControl -----------------------------------------------------------------------------------------

    def _is_master(self, credential: str) -> bool:
        return hmac.compare_digest(credential.encode(), self._master_key)

    async def authenticate(self, credential: str) -> Principal:
        if self._is_master(credential):
            return self._master
        if not credential.startswith(KEY_PREFIX):
            raise wrong_prefix_error()
        key_hash = hash_key(credential)
        cached = self._keys.get(key_hash)
        if cached is not None and self._keys.is_fresh(cached):
            cached.check()
            return cached.principal
        try:
            self._failures.check_redis_up()
            record = await self._store.find_by_secret(credential)
            team = None
            if record is not None and record.team_id is not None:  # its allowlist, weight and priority count too
                team = await self._store.hgetall(redis_names.team_record(record.team_id))
        except StorageError as exc:
            await self._failures.note_failure("authenticate", exc)
            return self._failures.without_redis(cached, None, exc, is_fresh=self._keys.is_fresh(cached))
        if record is None:
            self._keys.forget(key_hash)
            raise unknown_key_error()
        cached = self._keys.remember(key_hash, record)
        if team is not None:
            cached.set_team(CachedTeam.from_hash(team) if "id" in team else None)
        cached.check()
        return cached.principal

    async def admit(
        self, credential: str, *, model: str, estimated_tokens: int, request_id: str = "", budget: BudgetCost = NO_COST
    ) -> Admission:
        if self._is_master(credential):
            return Admission(principal=self._master, model=model, settles_late=True, request_id=request_id)
        if not credential.startswith(KEY_PREFIX):
            raise wrong_prefix_error()
        key_hash = hash_key(credential)
        cached = self._keys.get(key_hash)
        ask = _Ask(model, estimated_tokens, new_request_id(), budget)
        team_reply: scripts.AdmitReply | None = None
        try:
            self._failures.check_redis_up()
            key_id = cached.key_id if cached is not None else await self._store.find_id(key_hash)
            if key_id is None:
                raise unknown_key_error()
            guess = cached.team_id if cached is not None else None
            if cached is None or guess is None:  # no team (as far as this instance knows): the one round trip
                reply = await self._admit_one(key_id, key_hash, cached.version if cached is not None else None, ask)
            else:  # the key's and its team's admissions in one pipelined round trip
                reply, team_reply = await self._admit_pair(key_id, key_hash, cached, guess, ask)
            if reply.record:
                cached = self._keys.remember(key_hash, KeyRecord.from_hash(reply.record))
            if reply.status == "invalid_api_key":
                self._keys.forget(key_hash)
            if reply.status != "ok" or cached is None:
                await self._cancel_if_admitted(guess, team_reply, ask)
                raise rejection(reply, cached.principal if cached is not None else None, model, estimated_tokens)
            if cached.team_id != guess:  # the key's record names another team than this instance had cached
                await self._cancel_if_admitted(guess, team_reply, ask)
                team_reply = None
                if cached.team_id is not None:
                    team_reply = await self._admit_team_or_cancel(key_id, reply, cached, cached.team_id, ask)
            if team_reply is not None:
                team_reply = await self._check_team(key_id, reply, team_reply, cached, ask)
        except ScriptError as error:
            self._failures.note_script_error(error, request_id)
            raise
        except StorageError as exc:
            await self._failures.note_failure("admit", exc)
            principal = self._failures.without_redis(cached, model, exc, is_fresh=self._keys.is_fresh(cached))
            return Admission(
                principal=principal, model=model, lease_id=ask.lease_id, settles_late=True, request_id=request_id
            )
        cached.verified_at = time.monotonic()
        team_is_late = team_reply is None or (
            team_reply.leases_remaining != 0 and not (cached.team is not None and cached.team.reads_its_settles)
        )
        return Admission(
            principal=cached.principal,
            model=model,
            reserved_tokens=scripts.clamp_tokens(estimated_tokens),
            budget_tokens=scripts.clamp_tokens(budget.tokens),
            reserved_micros=reply.reserved_micros,
            lease_id=ask.lease_id,
            headers=_headers(reply, team_reply),
            # See Admission.settles_late: a budget or TPM check reads the charge, the last free slot its lease.
            settles_late=reply.leases_remaining != 0 and not cached.reads_its_settles and team_is_late,
            request_id=request_id,
            team_id=cached.team_id if team_reply is not None else None,
            team_reserved_micros=team_reply.reserved_micros if team_reply is not None else 0,
        )

    # -- a key and its team: two admissions in two slots, both taken or neither ---------------------------------

    def _admit_args(self, state_id: str, key_hash: str, version: int | None, ask: _Ask) -> scripts.AdmitArgs:
        return scripts.AdmitArgs(
            state_id,
            key_hash,
            ask.model,
            ask.estimated_tokens,
            ask.lease_id,
            self._lease_ttl_ms,
            self._window_ms,
            version,
            ask.budget.tokens,
            ask.budget.costs,
        )

    def _command(self, state_id: str, key_hash: str, version: int | None, ask: _Ask) -> tuple[EncodableT, ...]:
        return scripts.admit_command(self._admit_args(state_id, key_hash, version, ask), self._scripts)

    async def _admit_one(self, state_id: str, key_hash: str, version: int | None, ask: _Ask) -> scripts.AdmitReply:
        """One admission (a key's; a team's with `key_hash` ""), registering the script on NOSCRIPT."""
        return await scripts.admit_request(
            self._pipe, self._admit_args(state_id, key_hash, version, ask), self._scripts
        )

    async def _admit_pair(
        self, key_id: str, key_hash: str, cached: CachedKey, team_id: str, ask: _Ask
    ) -> tuple[scripts.AdmitReply, scripts.AdmitReply]:
        """The key's and the team's admissions queued together on the pipe (one write, one round trip on a single
        server; one per node, in parallel, when a cluster puts the two slots on two nodes). When one fails for
        Redis, the other is cancelled if it was admitted, and the failure raised."""
        state_id = redis_names.team_state_id(team_id)
        team_version = cached.team.version if cached.team is not None and cached.team.team_id == team_id else None
        key_command = self._command(key_id, key_hash, cached.version, ask)
        team_command = self._command(state_id, "", team_version, ask)
        key_future = self._pipe.submit(lambda: key_command, key=redis_names.key_record(key_id))
        team_future = self._pipe.submit(lambda: team_command, key=redis_names.team_record(team_id))
        replies = (
            await self._reply(key_future, key_id, key_hash, cached.version, ask),
            await self._reply(team_future, state_id, "", team_version, ask),
        )
        failure = next((reply for reply in replies if not isinstance(reply, scripts.AdmitReply)), None)
        key_reply, team_reply = replies
        if failure is not None:
            if isinstance(key_reply, scripts.AdmitReply) and key_reply.status == "ok":
                await self._cancel(key_id, key_reply, ask)
            if isinstance(team_reply, scripts.AdmitReply) and team_reply.status == "ok":
                await self._cancel(state_id, team_reply, ask)
            raise failure
        assert isinstance(key_reply, scripts.AdmitReply) and isinstance(team_reply, scripts.AdmitReply)
        return key_reply, team_reply

    async def _reply(
        self, future: asyncio.Future[Any], state_id: str, key_hash: str, version: int | None, ask: _Ask
    ) -> scripts.AdmitReply | StorageError | ScriptError:
        """One pipelined admission's reply, or what failed (so that the other's can still be read and undone)."""
        try:
            try:
                return scripts.admit_reply(await future, self._scripts)
            except NoScriptError:  # Redis restarted or was flushed: register and ask again
                return await self._admit_one(state_id, key_hash, version, ask)
            except (TimeoutError, RedisError, OSError) as exc:
                raise scripts.classify_failure(exc, self._scripts.admit) from exc
        except (StorageError, ScriptError) as error:
            return error

    async def _admit_team_or_cancel(
        self, key_id: str, key_reply: scripts.AdmitReply, cached: CachedKey, team_id: str, ask: _Ask
    ) -> scripts.AdmitReply:
        """The team's admission after the key's (its team was not known before the key's reply): on a failure for
        Redis the key's admission is cancelled before the failure is raised."""
        version = cached.team.version if cached.team is not None and cached.team.team_id == team_id else None
        try:
            return await self._admit_one(redis_names.team_state_id(team_id), "", version, ask)
        except (StorageError, ScriptError):
            await self._cancel(key_id, key_reply, ask)
            raise

    async def _check_team(
        self,
        key_id: str,
        key_reply: scripts.AdmitReply,
        team_reply: scripts.AdmitReply,
        cached: CachedKey,
        ask: _Ask,
    ) -> scripts.AdmitReply | None:
        """Refresh the cached team from its reply; a refusal cancels the key's admission and raises (naming the
        team). None: the team is gone (deleted under the key), so only the key's limits apply."""
        if team_reply.status == "team_not_found":
            cached.set_team(None)
            return None
        if team_reply.record:
            cached.set_team(CachedTeam.from_hash(team_reply.record))
        if team_reply.status != "ok":
            await self._cancel(key_id, key_reply, ask)
            name = cached.team.name if cached.team is not None else cached.team_id
            raise rejection(team_reply, cached.principal, ask.model, ask.estimated_tokens, team_name=name or "")
        return team_reply

    async def _cancel_if_admitted(self, team_id: str | None, reply: scripts.AdmitReply | None, ask: _Ask) -> None:
        if team_id is not None and reply is not None and reply.status == "ok":
            await self._cancel(redis_names.team_state_id(team_id), reply, ask)

    async def _cancel(self, state_id: str, reply: scripts.AdmitReply, ask: _Ask) -> None:
        """Undo one half of an admission whose other half was refused. Best effort: if Redis cannot take it, the
        entries age out (rate logs after the window, the lease and the budget hold after the lease ttl), which only
        ever counts too much, never too little."""
        try:
            await scripts.cancel_admission(
                self._pipe,
                state_id=state_id,
                request_id=ask.lease_id,
                reserved_tokens=ask.estimated_tokens,
                budget_tokens=ask.budget.tokens,
                reserved_micros=reply.reserved_micros,
                scripts=self._scripts,
            )
        except ScriptError as error:
            self._failures.note_script_error(error, ask.lease_id)
        except StorageError as exc:
            await self._failures.note_failure("cancel_admission", exc)

    def begin_settle(self, admission: Admission, usage: SettleUsage) -> Awaitable[None]:
        """True up the reservation, release the concurrency lease and record usage and spend; queued on the
        command pipe before this returns. Never fails for Redis failures: the reservation then ages out of the
        window and the lease expires."""
        return self._settles.begin(admission, usage)

    async def settle(self, admission: Admission, usage: SettleUsage) -> None:
        await self.begin_settle(admission, usage)
