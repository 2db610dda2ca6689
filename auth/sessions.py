"""Console sessions: what a browser holds instead of the master key, kept in Redis so every instance agrees.

A session id is 256 random bits handed to the browser once (the cookie); Redis keeps only its SHA-256, so a copy
of Redis holds nothing a browser could present. Each record carries the session's CSRF token and a fingerprint of
the master key it was opened with (an HMAC keyed by that master key over the session id): when the master key
changes, no session matches any more, on every instance at once. Logout deletes the record; the TTL ends it
otherwise. Login attempts are counted per client address in fixed one-minute windows.
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

__all__ = ["LoginWindow", "Session", "SessionStore"]

_NUM_ID_BYTES = 32
_LOGIN_WINDOW_S = 60


@dataclass(frozen=True, slots=True)
class Session:
    id: str  # the cookie value (never stored)
    csrf_token: str
    created_at_ms: int
    expires_in_s: int


@dataclass(frozen=True, slots=True)
class LoginWindow:
    """Login attempts from one client address in the current minute."""

    num_attempts: int
    retry_after_s: int  # seconds until the window ends


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

    async def count_login(self, client: str) -> LoginWindow:
        """Count one login attempt from `client` (an address) in its current one-minute window."""
        name = redis_names.login_attempts(client)
        async with storage_errors():
            # SET NX EX opens the window (works on Redis 6.2, unlike EXPIRE NX); INCR counts in it. In a cluster the
            # three are not one transaction: a counter left without expiry (the window ended between them) gets one.
            async with self.redis.pipeline(transaction=not is_cluster(self.redis)) as pipe:
                pipe.set(name, 0, ex=_LOGIN_WINDOW_S, nx=True)
                pipe.incr(name)
                pipe.ttl(name)
                _, count, ttl = await pipe.execute()
            if int(ttl) < 0:
                await self.redis.expire(name, _LOGIN_WINDOW_S)
                ttl = _LOGIN_WINDOW_S
        return LoginWindow(num_attempts=int(count), retry_after_s=max(int(ttl), 1))
