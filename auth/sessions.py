"""Console sessions: what a browser holds instead of the master key, kept in Redis so every instance agrees.

A session id is 256 random bits handed to the browser once (the cookie); Redis keeps only its SHA-256, so a copy
of Redis holds nothing a browser could present. Each record carries the session's CSRF token and a fingerprint of
the master key it was opened with (an HMAC keyed by that master key over the session id): when the master key
changes, no session matches any more, on every instance at once. Logout deletes the record; the TTL ends it
otherwise.

`AuthLimiter` counts what could guess the master key: console login attempts and failed master-key checks on the
admin API, together, per client address in fixed one-minute windows (and per trusted proxy for the clients it
forwards, with a higher limit, so rotating forwarded addresses cannot buy unlimited guesses).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import orjson

from auth import redis_names
from auth.redis_client import RedisClient, is_cluster
from auth.scripts import as_text, storage_errors

__all__ = ["AuthLimiter", "AuthWindow", "Session", "SessionStore"]

_NUM_ID_BYTES = 32
_AUTH_WINDOW_S = 60


@dataclass(frozen=True, slots=True)
class Session:
    id: str  # the cookie value (never stored)
    csrf_token: str
    created_at_ms: int
    expires_in_s: int


@dataclass(frozen=True, slots=True)
class AuthWindow:
    """Where one client stands in its current one-minute window of authentication attempts."""

    is_blocked: bool
    retry_after_s: int  # seconds until the window that blocks it ends (0 when not blocked)


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _fingerprint(master_key: str, session_id: str) -> str:
    return hmac.new(master_key.encode(), b"unigate-console:" + session_id.encode(), hashlib.sha256).hexdigest()


class SessionStore:
    def __init__(self, redis: RedisClient, *, ttl_s: int) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def create(self, master_key: str) -> Session:
        """A new session for the holder of `master_key` (the caller has checked it)."""
        session_id = secrets.token_urlsafe(_NUM_ID_BYTES)
        csrf_token = secrets.token_urlsafe(_NUM_ID_BYTES)
        async with storage_errors():
            seconds, micros = await self.redis.time()
            created_at_ms = int(seconds) * 1000 + int(micros) // 1000
            record = {"csrf": csrf_token, "fingerprint": _fingerprint(master_key, session_id), "created": created_at_ms}
            await self.redis.set(redis_names.session(_hash(session_id)), orjson.dumps(record), ex=self.ttl_s)
        return Session(session_id, csrf_token, created_at_ms, self.ttl_s)

    async def get(self, session_id: str, master_key: str) -> Session | None:
        """The live session with this id, opened with this master key; else None."""
        if not session_id or len(session_id) > 128:
            return None
        name = redis_names.session(_hash(session_id))
        async with storage_errors(), self.redis.pipeline(transaction=False) as pipe:
            pipe.get(name)
            pipe.ttl(name)
            raw, ttl = await pipe.execute()
        if raw is None or int(ttl) <= 0:
            return None
        try:
            record = orjson.loads(as_text(raw))
        except orjson.JSONDecodeError:
            return None
        if not hmac.compare_digest(str(record.get("fingerprint", "")), _fingerprint(master_key, session_id)):
            return None
        return Session(session_id, str(record["csrf"]), int(record.get("created", 0)), int(ttl))

    async def delete(self, session_id: str) -> None:
        async with storage_errors():
            await self.redis.delete(redis_names.session(_hash(session_id)))


class AuthLimiter:
    """Authentication attempts per client address in fixed one-minute windows, in Redis so every instance agrees.

    A client whose address a trusted proxy forwarded (`peer` is that proxy, not the client) is also counted under
    the proxy, against `max_per_peer_per_min`: a proxy that lets its clients name any address cannot give them
    unlimited guesses, at the price that an attack through it can block everyone behind it for up to a minute.
    """

    def __init__(self, redis: RedisClient, *, max_per_min: int, max_per_peer_per_min: int) -> None:
        self.redis = redis
        self.max_per_min = max_per_min
        self.max_per_peer_per_min = max_per_peer_per_min

    def _windows(self, address: str, peer: str) -> list[tuple[str, int]]:
        windows = [(redis_names.auth_attempts(address), self.max_per_min)]
        if peer != address:
            windows.append((redis_names.auth_attempts_via_peer(peer), self.max_per_peer_per_min))
        return windows

    async def check(self, address: str, peer: str) -> AuthWindow:
        """May `address` (connected through `peer`) make one more attempt now? Counts nothing: one round trip of
        GETs, and one more for the time left when it may not."""
        windows = self._windows(address, peer)
        async with storage_errors():
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, _ in windows:
                    pipe.get(name)
                counts = await pipe.execute()
            full = [name for (name, limit), count in zip(windows, counts, strict=True) if int(count or 0) >= limit]
            if not full:
                return AuthWindow(is_blocked=False, retry_after_s=0)
            async with self.redis.pipeline(transaction=False) as pipe:
                for name in full:
                    pipe.ttl(name)
                ttls = [int(ttl) for ttl in await pipe.execute()]
            await self._expire_unexpired(full, ttls)
        return AuthWindow(is_blocked=True, retry_after_s=_seconds_left(ttls))

    async def count(self, address: str, peer: str) -> AuthWindow:
        """Count one attempt from `address` (through `peer`); blocked when that went over a limit."""
        windows = self._windows(address, peer)
        async with storage_errors():
            # SET NX EX opens a window (works on Redis 6.2, unlike EXPIRE NX); INCR counts in it. In a cluster the
            # address's and the proxy's counters live in different slots, so the commands are not one transaction.
            async with self.redis.pipeline(transaction=not is_cluster(self.redis)) as pipe:
                for name, _ in windows:
                    pipe.set(name, 0, ex=_AUTH_WINDOW_S, nx=True)
                    pipe.incr(name)
                    pipe.ttl(name)
                replies = await pipe.execute()
            counts = [int(count) for count in replies[1::3]]
            ttls = [int(ttl) for ttl in replies[2::3]]
            await self._expire_unexpired([name for name, _ in windows], ttls)
        over = [ttl for (_, limit), count, ttl in zip(windows, counts, ttls, strict=True) if count > limit]
        if not over:
            return AuthWindow(is_blocked=False, retry_after_s=0)
        return AuthWindow(is_blocked=True, retry_after_s=_seconds_left(over))

    async def _expire_unexpired(self, names: list[str], ttls: list[int]) -> None:
        # In a cluster the window can end between SET NX and INCR, leaving a counter without expiry: give it one.
        for name, ttl in zip(names, ttls, strict=True):
            if ttl == -1:
                await self.redis.expire(name, _AUTH_WINDOW_S)


def _seconds_left(ttls: list[int]) -> int:
    """Seconds until the last of these windows ends (-1: no expiry yet, given a full window; -2: just ended)."""
    return max(max(_AUTH_WINDOW_S if ttl == -1 else ttl for ttl in ttls), 1)
