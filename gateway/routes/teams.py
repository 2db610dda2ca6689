"""Admin API for teams: create, list, show, change and delete teams, list a team's keys, read a team's usage.

A team carries the same limits and budgets as a key; a key in a team is admitted only when both its own limits
and its team's admit it (`auth.teams`). Keys join or leave a team through `PATCH /admin/keys/{id}` (`team_id`).
Master key or console session only, as every admin route (`gateway.routes.admin_access`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth.admin import TeamCreateBody, TeamUpdateBody, parse_body, record_json, team_json, team_usage_json
from auth.teams import TeamRecord, TeamStore
from gateway.errors import InvalidRequestError
from gateway.routes.admin_access import int_param, json_response, team_store

__all__ = ["all_teams", "team_routes"]

_DEFAULT_PAGE_SIZE = 50
_MAX_PAGE_SIZE = 500


async def all_teams(teams: TeamStore) -> list[TeamRecord]:
    """Every team, in creation order (a page at a time)."""
    found: list[TeamRecord] = []
    cursor: str | None = None
    while True:
        records, cursor = await teams.list(limit=_MAX_PAGE_SIZE, cursor=cursor)
        found += records
        if cursor is None or not records:
            return found


def _force(request: Request) -> bool:
    raw = request.query_params.get("force", "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequestError("Query parameter 'force' must be true or false.", param="force")
    return raw in ("true", "1")


async def create_team(request: Request) -> Response:
    keys, teams = await team_store(request)
    body = parse_body(await request.body(), TeamCreateBody)
    team = await teams.create(**body.record_fields())
    return json_response(team_json(team, await keys.now_ms()), status_code=201)


async def list_teams(request: Request) -> Response:
    """`GET /admin/teams?limit=&after=`: teams in creation order; `after` is the previous page's `last_id`."""
    keys, teams = await team_store(request)
    limit = int_param(request, "limit", _DEFAULT_PAGE_SIZE, low=1, high=_MAX_PAGE_SIZE)
    assert limit is not None
    records, cursor = await teams.list(limit=limit, cursor=request.query_params.get("after"))
    now = await keys.now_ms()
    data = [team_json(team, now) for team in records]
    return json_response(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": cursor is not None,
        }
    )


async def get_team(request: Request) -> Response:
    keys, teams = await team_store(request)
    team = await teams.get(request.path_params["team_id"])
    return json_response(team_json(team, await keys.now_ms()))


async def update_team(request: Request) -> Response:
    keys, teams = await team_store(request)
    body = parse_body(await request.body(), TeamUpdateBody)
    team = await teams.update(request.path_params["team_id"], body.record_fields())
    return json_response(team_json(team, await keys.now_ms()))


async def delete_team(request: Request) -> Response:
    """`DELETE /admin/teams/{id}`: refused (`team_has_keys`) while keys are in it, unless `?force=true`, which takes
    them out of it first (they keep working, under their own limits only). Its usage history is deleted with it;
    its keys keep theirs."""
    _, teams = await team_store(request)
    team_id = request.path_params["team_id"]
    is_forced = _force(request)
    members = await teams.members(team_id) if is_forced else []
    await teams.delete(team_id, force=is_forced)
    return json_response({"object": "team.deleted", "id": team_id, "deleted": True, "detached_keys": members})


async def team_keys(request: Request) -> Response:
    """`GET /admin/teams/{id}/keys`: the team's keys (records as `GET /admin/keys` shows them), in id order."""
    keys, teams = await team_store(request)
    team_id = request.path_params["team_id"]
    await teams.get(team_id)  # 404 team_not_found
    now = await keys.now_ms()
    records = [await keys.get(key_id) for key_id in sorted(await teams.members(team_id))]
    return json_response({"object": "list", "team_id": team_id, "data": [record_json(r, now) for r in records]})


async def team_usage(request: Request) -> Response:
    """`GET /admin/teams/{id}/usage?days=N`: the team's own usage per model per UTC day (what its budgets count)."""
    _, teams = await team_store(request)
    num_days = int_param(request, "days", None, low=1, high=400)
    team_id = request.path_params["team_id"]
    return json_response(team_usage_json(team_id, await teams.usage(team_id, num_days=num_days)))


def team_routes() -> list[Route]:
    return [
        Route("/admin/teams", create_team, methods=["POST"]),
        Route("/admin/teams", list_teams, methods=["GET"]),
        Route("/admin/teams/{team_id}", get_team, methods=["GET"]),
        Route("/admin/teams/{team_id}", update_team, methods=["PATCH"]),
        Route("/admin/teams/{team_id}", delete_team, methods=["DELETE"]),
        Route("/admin/teams/{team_id}/keys", team_keys, methods=["GET"]),
        Route("/admin/teams/{team_id}/usage", team_usage, methods=["GET"]),
    ]
