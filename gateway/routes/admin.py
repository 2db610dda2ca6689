"""Admin API: manage keys and read usage. Master key only (a normal key gets 403 `admin_only`).

The app provides `app.state.key_store` (a `KeyStore`), `app.state.settings`, and optionally
`app.state.master_key` (the resolved master key; otherwise it is read from settings or the data directory).
"""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth.admin import KeyCreateBody, KeyUpdateBody, parse_body, record_json, totals_json, usage_json
from auth.base import extract_credential
from auth.master_key import read_master_key
from auth.store import KeyStore
from gateway.engine_metrics import local_engine_stats
from gateway.errors import AuthError, InvalidRequestError, PermissionDeniedError
from gateway.settings import Settings

__all__ = ["admin_routes"]

_DEFAULT_PAGE_SIZE = 50
_MAX_PAGE_SIZE = 500


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


async def _admin_store(request: Request) -> KeyStore:
    """The key store, once the caller has proven to hold the master key."""
    credential = extract_credential(request.headers)
    master_key = getattr(request.app.state, "master_key", None) or _read_master_key(request.app.state.settings)
    if master_key is not None and hmac.compare_digest(credential.encode(), master_key.encode()):
        store: KeyStore = request.app.state.key_store
        return store
    store = request.app.state.key_store
    record = await store.find_by_secret(credential)
    if record is not None and not record.is_revoked:
        raise PermissionDeniedError(
            "The admin API needs the master key; this is a normal API key. Use the master key "
            "(UNIGATE_MASTER_KEY or the data directory's master_key file).",
            code="admin_only",
        )
    raise AuthError("Invalid master key. The admin API accepts only the gateway's master key.")


def _int_param(request: Request, name: str, default: int | None, *, low: int, high: int) -> int | None:
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


async def create_key(request: Request) -> Response:
    store = await _admin_store(request)
    body = parse_body(await request.body(), KeyCreateBody)
    now = await store.now_ms()
    if body.expires_at is not None and body.expires_at.timestamp() * 1000 <= now:
        raise InvalidRequestError("'expires_at' is in the past; give a future RFC 3339 time.", param="expires_at")
    record, secret = await store.create(body.record_fields())
    return _json({**record_json(record, now), "key": secret}, status_code=201)


async def list_keys(request: Request) -> Response:
    store = await _admin_store(request)
    limit = _int_param(request, "limit", _DEFAULT_PAGE_SIZE, low=1, high=_MAX_PAGE_SIZE)
    assert limit is not None
    page = await store.list_keys(limit=limit, after=request.query_params.get("after"))
    now = await store.now_ms()
    data = [record_json(record, now) for record in page.records]
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


async def get_key(request: Request) -> Response:
    store = await _admin_store(request)
    record = await store.get(request.path_params["key_id"])
    return _json(record_json(record, await store.now_ms()))


async def update_key(request: Request) -> Response:
    store = await _admin_store(request)
    body = parse_body(await request.body(), KeyUpdateBody)
    record = await store.update(request.path_params["key_id"], body.record_fields())
    return _json(record_json(record, await store.now_ms()))


async def revoke_key(request: Request) -> Response:
    store = await _admin_store(request)
    record = await store.revoke(request.path_params["key_id"])
    return _json(record_json(record, await store.now_ms()))


async def rotate_key(request: Request) -> Response:
    store = await _admin_store(request)
    record, secret = await store.rotate(request.path_params["key_id"])
    return _json({**record_json(record, await store.now_ms()), "key": secret})


async def key_usage(request: Request) -> Response:
    store = await _admin_store(request)
    num_days = _int_param(request, "days", None, low=1, high=400)
    key_id = request.path_params["key_id"]
    return _json(usage_json(key_id, await store.usage(key_id, num_days=num_days)))


async def total_usage(request: Request) -> Response:
    store = await _admin_store(request)
    num_days = _int_param(request, "days", None, low=1, high=400)
    return _json(totals_json(await store.totals(num_days=num_days)))


async def engine_stats(request: Request) -> Response:
    """`GET /admin/engine`: the stats of every local-engine deployment (queues, KV blocks, prefix-cache hit rate,
    memory: weights / KV cache / peak, token rates, capacity)."""
    await _admin_store(request)
    return _json({"object": "list", "data": local_engine_stats(request.app.state.router)})


def admin_routes() -> list[Route]:
    return [
        Route("/admin/keys", create_key, methods=["POST"]),
        Route("/admin/keys", list_keys, methods=["GET"]),
        Route("/admin/keys/{key_id}", get_key, methods=["GET"]),
        Route("/admin/keys/{key_id}", update_key, methods=["PATCH"]),
        Route("/admin/keys/{key_id}", revoke_key, methods=["DELETE"]),
        Route("/admin/keys/{key_id}/rotate", rotate_key, methods=["POST"]),
        Route("/admin/keys/{key_id}/usage", key_usage, methods=["GET"]),
        Route("/admin/usage", total_usage, methods=["GET"]),
        Route("/admin/engine", engine_stats, methods=["GET"]),
    ]


def _read_master_key(settings: Settings) -> str | None:
    configured = settings.master_key.get_secret_value() if settings.master_key is not None else None
    return read_master_key(configured, settings.data_dir)
