"""What every admin route starts with: proving the master key (or a console session), the stores, JSON out and
integer query parameters. Shared by `gateway.routes.admin` (keys, usage, models, engine) and
`gateway.routes.teams`.

The app provides `app.state.key_store` (a `KeyStore`), `app.state.settings`, optionally `app.state.team_store`
(else one is built over the key store's Redis on first use) and optionally `app.state.master_key` (the resolved
master key; otherwise it is read from settings or the data directory).
"""

from __future__ import annotations

import hmac
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from auth.base import extract_credential
from auth.master_key import read_master_key
from auth.store import KeyRecord, KeyStore
from auth.teams import TeamStore
from gateway.client_address import client_address
from gateway.errors import AuthError, InvalidRequestError, PermissionDeniedError
from gateway.routes.ui import auth_limiter, has_session_cookie, require_session, too_many_attempts
from gateway.settings import Settings

__all__ = ["admin_or_key", "admin_store", "int_param", "json_response", "team_store"]


def json_response(data: dict[str, Any], status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


async def admin_store(request: Request) -> KeyStore:
    """The key store, once the caller has proven to hold the master key: as a bearer / x-api-key, or through a
    console session cookie (plus its CSRF token for a state-changing call) when no key header is sent.

    A wrong key counts against its client address like a console login (`gateway.routes.ui.auth_limiter`); an
    address over the limit is refused before its key is compared, so a blocked guesser learns nothing."""
    await _caller(request, is_key_allowed=False)
    store: KeyStore = request.app.state.key_store
    return store


async def admin_or_key(request: Request) -> KeyRecord | None:
    """None once the caller has proven to hold the master key (or a console session), as `admin_store`; else the
    record of the live API key it sent, for the admin routes a key owner may call about its own key."""
    return await _caller(request, is_key_allowed=True)


async def _caller(request: Request, *, is_key_allowed: bool) -> KeyRecord | None:
    if "authorization" not in request.headers and "x-api-key" not in request.headers and has_session_cookie(request):
        await require_session(request, is_state_changing=request.method not in ("GET", "HEAD"))
        return None
    client, limiter = client_address(request), auth_limiter(request)
    window = await limiter.check(client.address, client.peer)
    if window.is_blocked:
        raise too_many_attempts(window)
    credential = extract_credential(request.headers)
    master_key = getattr(request.app.state, "master_key", None) or _read_master_key(request.app.state.settings)
    if master_key is not None and hmac.compare_digest(credential.encode(), master_key.encode()):
        return None
    store: KeyStore = request.app.state.key_store
    record = await store.find_by_secret(credential)
    is_live = record is not None and not record.is_revoked
    if is_key_allowed and record is not None and is_live and not record.is_expired(int(time.time() * 1000)):
        return record
    await limiter.count(client.address, client.peer)
    if is_live:
        raise PermissionDeniedError(
            "The admin API needs the master key; this is a normal API key. Use the master key "
            "(UNIGATE_MASTER_KEY or the data directory's master_key file).",
            code="admin_only",
        )
    raise AuthError("Invalid master key. The admin API accepts only the gateway's master key.")


async def team_store(request: Request) -> tuple[KeyStore, TeamStore]:
    """The key and team stores, once the caller has proven to hold the master key (`admin_store`)."""
    keys = await admin_store(request)
    teams: TeamStore | None = getattr(request.app.state, "team_store", None)
    if teams is None:
        teams = request.app.state.team_store = TeamStore(keys.redis)
    return keys, teams


def int_param(request: Request, name: str, default: int | None, *, low: int, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequestError(f"Query parameter '{name}' must be an integer from {low} to {high}.", param=name)
    return value


def _read_master_key(settings: Settings) -> str | None:
    configured = settings.master_key.get_secret_value() if settings.master_key is not None else None
    return read_master_key(configured, settings.data_dir)
