"""`GET /admin/requests` and `GET /admin/requests/{request_id}`: the request log (auth/request_log.py), for the
master key or a console session, and for an API key's owner its own key's records only: read with that key, a
listing keeps that key's records (asking for another key's or team's: 403 `admin_only`) and another key's record
is not found (404, as if it did not exist).

    GET /admin/requests?key=&team=&model=&deployment=&status=&code=&since=&until=&limit=&cursor=
        newest first; `since` / `until` are RFC 3339 times or ms since the epoch; `next_cursor` continues
    GET /admin/requests?after=<position>
        the live tail: records newer than `position` (oldest first) and the position to ask from next time;
        `after=now` starts from the newest record
    GET /admin/requests/{request_id}
        one record (404 `request_not_found` when it is unknown or older than the retention)
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth.request_log import RequestFilter, RequestLog, RequestRecord
from auth.store import KeyRecord
from gateway.errors import InvalidRequestError, NotFoundError, PermissionDeniedError, UnavailableError
from gateway.routes.admin_access import admin_or_key

__all__ = ["record_json", "request_log_routes"]

_DEFAULT_PAGE = 50
_MAX_PAGE = 500


def record_json(record: RequestRecord) -> dict[str, Any]:
    """A record as the API shows it: times as RFC 3339, cost in the price currency as a decimal string."""
    return {
        "request_id": record.request_id,
        "time": dt.datetime.fromtimestamp(record.time_ms / 1000, tz=dt.UTC).isoformat(timespec="milliseconds"),
        "key_id": record.key_id or "master",
        "key_name": record.key_name,
        "team_id": record.team_id,
        "api": record.api,
        "route": record.route,
        "model": record.model,
        "deployment": record.deployment,
        "fallback": record.fallback,
        "status": record.status,
        "code": record.code or None,
        "ended_by": record.ended_by,
        "stream": record.is_stream,
        "attempts": [
            {
                "deployment": a.deployment,
                "status": a.status,
                "start_ms": a.start_ms,
                "duration_ms": a.duration_ms,
                "code": a.code or None,
            }
            for a in record.attempts
        ],
        "usage": {
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "estimated": record.is_estimated,
        },
        "cost_usd": str(Decimal(record.cost_micros) / 1_000_000),
        "ttft_ms": record.ttft_ms,
        "duration_ms": record.duration_ms,
    }


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


def _request_log(request: Request) -> RequestLog:
    log: RequestLog | None = getattr(request.app.state, "request_log", None)
    if log is None:
        raise UnavailableError("The request log is off on this gateway (UNIGATE_REQUEST_LOG__ENABLED=false).")
    return log


def _time_param(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    if raw.isdigit():
        return int(raw)
    try:
        parsed = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise InvalidRequestError(
            f"Query parameter '{name}' must be an RFC 3339 time with a zone (2026-12-06T15:00:00Z) or ms since the "
            "epoch.",
            param=name,
        )
    return int(parsed.timestamp() * 1000)


def _int_param(request: Request, name: str, default: int, *, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise InvalidRequestError(f"Query parameter '{name}' must be an integer from {low} to {high}.", param=name)
    return int(raw)


def _filter(request: Request, owner: KeyRecord | None) -> RequestFilter:
    params = request.query_params
    status = params.get("status")
    if status is not None and not (status.isdigit() and 100 <= int(status) <= 599):
        raise InvalidRequestError("Query parameter 'status' must be an HTTP status (100-599).", param="status")
    key, team = params.get("key"), params.get("team")
    key_id = "" if key == "master" else key
    if owner is not None:
        if key_id not in (None, owner.id) or team not in (None, owner.team_id):
            raise PermissionDeniedError(
                "An API key reads only its own key's records; other keys' and teams' need the master key.",
                code="admin_only",
            )
        key_id = owner.id
    return RequestFilter(
        key_id=key_id,
        team_id=team,
        model=params.get("model"),
        deployment=params.get("deployment"),
        status=int(status) if status is not None else None,
        code=params.get("code"),
        start_ms=_time_param(request, "since"),
        end_ms=_time_param(request, "until"),
    )


async def list_requests(request: Request) -> Response:
    owner = await admin_or_key(request)
    log = _request_log(request)
    after = request.query_params.get("after")
    if after is not None:
        if after != "now" and not _is_entry_id(after):
            raise InvalidRequestError("Query parameter 'after' must be 'now' or a position this API returned.")
        where = _filter(request, owner) if owner is not None else RequestFilter()
        limit = _int_param(request, "limit", 100, low=1, high=_MAX_PAGE)
        records, position = await log.after(None if after == "now" else after, limit=limit)
        data = [record_json(r) for r in records if where.matches(r)]  # the position moves past the others too
        return _json({"object": "list", "data": data, "position": position})
    cursor = request.query_params.get("cursor")
    if cursor is not None and not _is_entry_id(cursor):
        raise InvalidRequestError("Query parameter 'cursor' must be a next_cursor this API returned.", param="cursor")
    limit = _int_param(request, "limit", _DEFAULT_PAGE, low=1, high=_MAX_PAGE)
    page = await log.page(_filter(request, owner), limit=limit, cursor=cursor)
    return _json(
        {
            "object": "list",
            "data": [record_json(r) for r in page.records],
            "next_cursor": page.next_cursor,
            "num_dropped": page.num_dropped,
        }
    )


async def get_request(request: Request) -> Response:
    owner = await admin_or_key(request)
    request_id = request.path_params["request_id"]
    record = await _request_log(request).get(request_id)
    if record is None or (owner is not None and record.key_id != owner.id):  # another key's: as if unknown
        raise NotFoundError(
            f"No request {request_id!r} in the request log (unknown, or older than its retention).",
            code="request_not_found",
        )
    return _json(record_json(record))


def _is_entry_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isdigit() and seq.isdigit() and len(value) <= 40


def request_log_routes() -> list[Route]:
    return [
        Route("/admin/requests", list_requests, methods=["GET"]),
        Route("/admin/requests/{request_id}", get_request, methods=["GET"]),
    ]
