"""Admin API: manage keys and read usage and the routing table (teams: `gateway.routes.teams`). Master key only
(a normal key gets 403 `admin_only`), or the operator console's session cookie (`gateway.routes.ui`); what the app
must provide is in `gateway.routes.admin_access`.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth import redis_names
from auth.admin import (
    KeyCreateBody,
    KeyUpdateBody,
    parse_body,
    record_json,
    rfc3339,
    team_totals_json,
    totals_json,
    usage_json,
)
from auth.store import KeyRecord, KeyStore
from gateway.engine_metrics import local_engine_stats
from gateway.errors import InvalidRequestError
from gateway.health_probe import HealthProber
from gateway.metrics import GatewayMetrics
from gateway.router import Deployment, Router
from gateway.routes.admin_access import admin_store, int_param, json_response, team_store
from gateway.routes.teams import all_teams, team_routes

__all__ = ["admin_routes"]

_DEFAULT_PAGE_SIZE = 50
_MAX_PAGE_SIZE = 500
_MAX_SEARCH_SCAN = 10_000  # keys one `GET /admin/keys?search=` call reads at most (then `has_more`, go on `after`)
_MAX_COOLING_SHOWN = 20  # a wildcard deployment's cooling models listed by GET /admin/models (all are counted)


async def create_key(request: Request) -> Response:
    store = await admin_store(request)
    body = parse_body(await request.body(), KeyCreateBody)
    now = await store.now_ms()
    if body.expires_at is not None and body.expires_at.timestamp() * 1000 <= now:
        raise InvalidRequestError("'expires_at' is in the past; give a future RFC 3339 time.", param="expires_at")
    fields = body.record_fields()
    record, secret = await store.create(fields, team_id=fields.pop("team_id"))  # 404 team_not_found
    return json_response({**record_json(record, now), "key": secret}, status_code=201)


async def list_keys(request: Request) -> Response:
    store = await admin_store(request)
    limit = int_param(request, "limit", _DEFAULT_PAGE_SIZE, low=1, high=_MAX_PAGE_SIZE)
    assert limit is not None
    after = request.query_params.get("after")
    search = request.query_params.get("search", "").strip().lower()
    if not search:
        page = await store.list_keys(limit=limit, after=after)
        records, has_more = page.records, page.has_more
        last_id = page.records[-1].id if page.records else None
    else:
        records, has_more, last_id = await _search_keys(store, search, limit, after)
    now = await store.now_ms()
    data = [record_json(record, now) for record in records]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": last_id,
            "has_more": has_more,
        }
    )


async def _search_keys(
    store: KeyStore, search: str, limit: int, after: str | None
) -> tuple[list[KeyRecord], bool, str | None]:
    """Keys whose name, id or display prefix contains `search` (case-insensitive), in creation order, scanning at
    most `_MAX_SEARCH_SCAN` keys per call; `last_id` is where the scan stopped (the next page's `after`)."""
    found: list[KeyRecord] = []
    scanned, last_id = 0, after
    while scanned < _MAX_SEARCH_SCAN:
        page = await store.list_keys(limit=_MAX_PAGE_SIZE, after=last_id)
        for record in page.records:
            scanned += 1
            last_id = record.id
            if any(search in value.lower() for value in (record.name, record.id, record.key_prefix)):
                found.append(record)
                if len(found) == limit:
                    return found, True, last_id
        if not page.has_more:
            return found, False, last_id
    return found, True, last_id


async def get_key(request: Request) -> Response:
    store = await admin_store(request)
    record = await store.get(request.path_params["key_id"])
    return json_response(record_json(record, await store.now_ms()))


async def update_key(request: Request) -> Response:
    """`PATCH /admin/keys/{id}`; a `team_id` moves the key into that team (`null`: out of its team). The key's own
    usage history stays with the key; from now on its requests also count against the new team."""
    store = await admin_store(request)
    body = parse_body(await request.body(), KeyUpdateBody)
    record = await store.update(request.path_params["key_id"], body.record_fields())  # 404 team_not_found
    return json_response(record_json(record, await store.now_ms()))


async def revoke_key(request: Request) -> Response:
    store = await admin_store(request)
    record = await store.revoke(request.path_params["key_id"])
    return json_response(record_json(record, await store.now_ms()))


async def rotate_key(request: Request) -> Response:
    store = await admin_store(request)
    record, secret = await store.rotate(request.path_params["key_id"])
    return json_response({**record_json(record, await store.now_ms()), "key": secret})


async def key_usage(request: Request) -> Response:
    store = await admin_store(request)
    num_days = int_param(request, "days", None, low=1, high=400)
    key_id = request.path_params["key_id"]
    return json_response(usage_json(key_id, await store.usage(key_id, num_days=num_days)))


async def total_usage(request: Request) -> Response:
    """`GET /admin/usage?days=N`: totals over every key and the master key; with `team=<id>`, over that team's own
    usage (every request its keys made while in it, also of keys that have left it since)."""
    num_days = int_param(request, "days", None, low=1, high=400)
    team_id = request.query_params.get("team")
    if team_id is None:
        store = await admin_store(request)
        return json_response(totals_json(await store.totals(num_days=num_days)))
    _, teams = await team_store(request)
    team = await teams.get(team_id)
    return json_response(team_totals_json(team, await teams.totals(team_id, num_days=num_days)))


async def engine_stats(request: Request) -> Response:
    """`GET /admin/engine`: the stats of every local-engine deployment (queues, KV blocks, prefix-cache hit rate,
    memory: weights / KV cache / peak, token rates, capacity)."""
    await admin_store(request)
    return json_response({"object": "list", "data": local_engine_stats(request.app.state.router)})


async def usage_rows(request: Request) -> Response:
    """`GET /admin/usage/rows?days=N` (default 30): usage per UTC day, key (the master key as `master`) and model
    over the last N days, each with the key's current team (`team_id`, `team_name`; null without one): the rows the
    console's Usage page groups and exports as CSV. `team=<id>` keeps the rows of that team's keys."""
    store, teams = await team_store(request)
    num_days = int_param(request, "days", 30, low=1, high=400)
    only_team = request.query_params.get("team")
    team_names = {team.id: team.name for team in await all_teams(teams)}
    if only_team is not None and only_team not in team_names:
        await teams.get(only_team)  # 404 team_not_found
    keys: dict[str, tuple[str, str | None]] = {redis_names.MASTER_ID: ("master key", None)}
    after: str | None = None
    while True:
        page = await store.list_keys(limit=_MAX_PAGE_SIZE, after=after)
        keys.update((record.id, (record.name, record.team_id)) for record in page.records)
        if not page.has_more or not page.records:
            break
        after = page.records[-1].id
    if only_team is not None:
        keys = {key_id: key for key_id, key in keys.items() if key[1] == only_team}
    data = []
    usage = await store.usage_many(list(keys), num_days=num_days)
    for key_id, (name, team_id) in keys.items():
        team = {"team_id": team_id, "team_name": team_names.get(team_id) if team_id else None}
        for row in usage_json(key_id, usage[key_id])["data"]:
            data.append({"key_id": key_id, "key_name": name, **team, **row})
    data.sort(key=lambda row: (row["date"], row["key_id"], row["model"]))
    return json_response({"object": "list", "days": num_days, "data": data})


async def models(request: Request) -> Response:
    """`GET /admin/models`: the routing table as this instance sees it — ids, aliases, fallbacks, and per deployment
    its upstream host (never its key), state (and the reason of a `load_failed`), cooldown, the models of a wildcard
    deployment that cool down on their own, in-flight requests, and its attempts, errors and summed latency since
    start (a reader takes differences between two reads for recent figures). A model with `slo` shows it, and each
    of its deployments its admission state (`DeploymentSlo.state`: live limit, in flight, queued, shed, window
    p50 / p95 TTFT and TPOT)."""
    await admin_store(request)
    router: Router = request.app.state.router
    prober: HealthProber = request.app.state.health_prober
    states, reasons = prober.states(), prober.reasons()
    attempts = _upstream_counters(request.app.state.metrics)
    now_wall, now_mono = time.time(), time.monotonic()
    data = []
    for route in router.routes:
        deployments = []
        for deployment in route.deployments:
            config = deployment.config
            remaining = max(0.0, deployment.cooldown_until - now_mono)
            counts = attempts.get(config.name, {})
            deployments.append(
                {
                    "name": config.name,
                    "type": config.type,
                    "host": _host_of(config.base_url),
                    "upstream_model": config.model,
                    "weight": config.weight,
                    "state": states.get(config.name, "up"),
                    "state_reason": reasons.get(config.name),  # e.g. checkpoint_not_found for `load_failed`
                    "cooldown_until": rfc3339(int((now_wall + remaining) * 1000)) if remaining > 0 else None,
                    "cooldown_remaining_s": round(remaining, 3),
                    "num_in_flight": deployment.num_in_flight,
                    "max_in_flight": config.max_in_flight,
                    "num_attempts": int(counts.get("ok_count", 0) + counts.get("error_count", 0)),
                    "num_errors": int(counts.get("error_count", 0)),
                    "latency_sum_s": counts.get("ok_sum", 0.0) + counts.get("error_sum", 0.0),
                    "slo": deployment.slo.state() if deployment.slo is not None else None,
                    **_cooling_models(deployment, now_wall, now_mono),
                }
            )
        data.append(
            {
                "id": route.id,
                "aliases": list(route.config.aliases),
                "fallbacks": list(router.fallbacks.get(route.id, [])),
                "slo": route.config.slo.model_dump() if route.config.slo is not None else None,
                "deployments": deployments,
            }
        )
    return json_response({"object": "list", "data": data})


def _cooling_models(deployment: Deployment, now_wall: float, now_mono: float) -> dict[str, Any]:
    """A wildcard deployment's models that cool down on their own while the deployment serves the others (the
    router's per-model records): how many, and the first `_MAX_COOLING_SHOWN` by name with their cooldowns."""
    cooling = sorted(
        (name, h.cooldown_until - now_mono) for name, h in deployment.models.items() if h.cooldown_until > now_mono
    )
    return {
        "num_cooling_models": len(cooling),
        "cooling_models": [
            {
                "model": name,
                "cooldown_until": rfc3339(int((now_wall + remaining) * 1000)),
                "cooldown_remaining_s": round(remaining, 3),
            }
            for name, remaining in cooling[:_MAX_COOLING_SHOWN]
        ],
    }


def _host_of(base_url: str | None) -> str | None:
    """`host[:port]` of an upstream URL: no scheme, path, query or credentials."""
    if not base_url:
        return None
    parts = urlsplit(base_url)
    if parts.hostname is None:
        return None
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname


def _upstream_counters(metrics: GatewayMetrics) -> dict[str, dict[str, float]]:
    """deployment → {"ok_count", "ok_sum", "error_count", "error_sum"} from the upstream latency histogram."""
    counters: dict[str, dict[str, float]] = {}
    for family in metrics.upstream_latency.collect():
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in ("count", "sum"):
                deployment, outcome = sample.labels["deployment"], sample.labels["outcome"]
                counters.setdefault(deployment, {})[f"{outcome}_{kind}"] = sample.value
    return counters


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
        Route("/admin/usage/rows", usage_rows, methods=["GET"]),
        Route("/admin/models", models, methods=["GET"]),
        Route("/admin/engine", engine_stats, methods=["GET"]),
        *team_routes(),
    ]
