"""Teams through the admin routes (inline Starlette app, real Redis): lifecycle, strict bodies, members, deleting
with and without force, moving keys, usage by team."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from auth.base import SettleUsage


async def _team(admin: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await admin.post("/admin/teams", json={"name": "team", **body})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def _key(admin: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await admin.post("/admin/keys", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_team_lifecycle(admin: httpx.AsyncClient) -> None:
    body = {
        "name": "search",
        "models": ["openai/*", "local"],
        "rpm": 600,
        "tpm": 100_000,
        "max_concurrent": 16,
        "token_budget": 5_000_000,
        "budget_usd": "250.5",
        "budget_period": "month",
        "weight": 3,
        "priority": "high",
        "metadata": {"owner": "ana"},
    }
    created = await _team(admin, **body)
    assert created["object"] == "team" and created["id"].startswith("team_") and len(created["id"]) == 21
    for name, value in body.items():
        expected = 250.5 if name == "budget_usd" else value
        assert created[name] == expected, name
    assert (created["num_keys"], created["spend_usd"], created["budget_usd_spent"]) == (0, 0, 0)
    assert (created["budget_remaining"], created["budget_usd_remaining"]) == (5_000_000, 250.5)
    assert created["created_at"].endswith("Z")

    team_id = created["id"]
    assert (await admin.get(f"/admin/teams/{team_id}")).json() == created
    patched = await admin.patch(f"/admin/teams/{team_id}", json={"rpm": None, "tpm": 50, "priority": "low"})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["rpm"], patched.json()["tpm"], patched.json()["priority"]) == (None, 50, "low")
    assert patched.json()["name"] == "search" and patched.json()["weight"] == 3

    deleted = await admin.delete(f"/admin/teams/{team_id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"object": "team.deleted", "id": team_id, "deleted": True, "detached_keys": []}
    gone = await admin.get(f"/admin/teams/{team_id}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "team_not_found"


async def test_defaults_and_paging(admin: httpx.AsyncClient) -> None:
    teams = [await _team(admin, name=f"t{i}") for i in range(5)]
    first = teams[0]
    assert [first[f] for f in ("rpm", "tpm", "max_concurrent", "token_budget", "budget_usd")] == [None] * 5
    assert (first["models"], first["weight"], first["priority"], first["budget_period"]) == ([], 1.0, "normal", "total")
    page1 = (await admin.get("/admin/teams", params={"limit": 2})).json()
    assert [t["name"] for t in page1["data"]] == ["t0", "t1"] and page1["has_more"] is True
    page2 = (await admin.get("/admin/teams", params={"limit": 2, "after": page1["last_id"]})).json()
    page3 = (await admin.get("/admin/teams", params={"limit": 2, "after": page2["last_id"]})).json()
    assert [t["name"] for t in page2["data"] + page3["data"]] == ["t2", "t3", "t4"]
    assert page3["has_more"] is False and page3["last_id"] == teams[4]["id"]
    bad = await admin.get("/admin/teams", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    unknown = await admin.get("/admin/teams", params={"after": "team_0000000000000000"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rpm": -1}, "rpm"),
        ({"rpm": True}, "rpm"),
        ({"tpm": "60"}, "tpm"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"token_budget": 2**53 + 1}, "token_budget"),
        ({"budget_usd": True}, "budget_usd"),
        ({"budget_usd": "1.0000001"}, "budget_usd"),
        ({"budget_period": "week"}, "budget_period"),
        ({"weight": 0}, "weight"),
        ({"weight": -1.5}, "weight"),
        ({"weight": True}, "weight"),
        ({"weight": "2"}, "weight"),
        ({"priority": "urgent"}, "priority"),
        ({"models": ["gpt-[45]"]}, "models"),
        ({"name": "ops\r\nX-Injected: 1"}, "name"),
        ({"name": "nul\u0000"}, "name"),
        ({"name": ""}, "name"),
        ({"unknown": 1}, "unknown"),
        ({"expires_at": "2099-01-01T00:00:00Z"}, "expires_at"),  # a key's field, not a team's
    ],
)
async def test_invalid_team_bodies_name_the_field(admin: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    response = await admin.post("/admin/teams", json={"name": "t", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    team = await _team(admin)
    response = await admin.patch(f"/admin/teams/{team['id']}", json=body)  # the same rules on update
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_nulls_that_mean_nothing_are_refused(admin: httpx.AsyncClient) -> None:
    team = await _team(admin, weight=2)
    for name in ("name", "models", "budget_period", "metadata", "weight", "priority"):
        response = await admin.patch(f"/admin/teams/{team['id']}", json={name: None})
        assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text
    missing_name = await admin.post("/admin/teams", json={})
    assert missing_name.status_code == 400 and missing_name.json()["error"]["param"] == "name"


async def test_unknown_teams_are_404(admin: httpx.AsyncClient) -> None:
    unknown = "team_0000000000000000"
    for method, path in [
        ("GET", f"/admin/teams/{unknown}"),
        ("PATCH", f"/admin/teams/{unknown}"),
        ("DELETE", f"/admin/teams/{unknown}"),
        ("DELETE", f"/admin/teams/{unknown}?force=true"),
        ("GET", f"/admin/teams/{unknown}/usage"),
        ("GET", f"/admin/teams/{unknown}/keys"),
        ("GET", f"/admin/usage?team={unknown}"),
        ("GET", f"/admin/usage/rows?team={unknown}"),
        ("GET", "/admin/teams/nope"),
    ]:
        response = await admin.request(method, path, json={"rpm": 1} if method == "PATCH" else None)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "team_not_found"
    for body in ({"team_id": unknown}, {}):
        key = await admin.post("/admin/keys", json=body)
        if body:
            assert key.status_code == 404 and key.json()["error"]["code"] == "team_not_found"
    moved = await admin.patch(f"/admin/keys/{key.json()['id']}", json={"team_id": unknown})
    assert moved.status_code == 404 and moved.json()["error"]["code"] == "team_not_found"
    malformed = await admin.post("/admin/keys", json={"team_id": "search"})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "team_id"


async def test_keys_join_move_and_leave_teams(admin: httpx.AsyncClient) -> None:
    search, ads = await _team(admin, name="search"), await _team(admin, name="ads")
    key = await _key(admin, name="k1", team_id=search["id"], weight=2.5, priority="low")
    assert (key["team_id"], key["weight"], key["priority"]) == (search["id"], 2.5, "low")
    plain = await _key(admin, name="k2")
    assert (plain["team_id"], plain["weight"], plain["priority"]) == (None, 1.0, "normal")

    assert (await admin.get(f"/admin/teams/{search['id']}")).json()["num_keys"] == 1
    members = (await admin.get(f"/admin/teams/{search['id']}/keys")).json()
    assert [k["id"] for k in members["data"]] == [key["id"]] and "key" not in members["data"][0]

    moved = (await admin.patch(f"/admin/keys/{key['id']}", json={"team_id": ads["id"]})).json()
    assert moved["team_id"] == ads["id"] and moved["weight"] == 2.5
    assert (await admin.get(f"/admin/teams/{search['id']}")).json()["num_keys"] == 0
    assert [k["id"] for k in (await admin.get(f"/admin/teams/{ads['id']}/keys")).json()["data"]] == [key["id"]]

    out = (await admin.patch(f"/admin/keys/{key['id']}", json={"team_id": None})).json()
    assert out["team_id"] is None
    assert (await admin.get(f"/admin/teams/{ads['id']}")).json()["num_keys"] == 0
    for body, param in [({"weight": 0}, "weight"), ({"priority": "top"}, "priority"), ({"weight": None}, "weight")]:
        refused = await admin.patch(f"/admin/keys/{key['id']}", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


async def test_delete_with_keys_needs_force_which_detaches_them(admin: httpx.AsyncClient) -> None:
    team = await _team(admin, name="doomed", rpm=1)
    keys = [await _key(admin, name=f"m{i}", team_id=team["id"]) for i in range(2)]
    refused = await admin.delete(f"/admin/teams/{team['id']}")
    assert refused.status_code in (400, 409) and refused.json()["error"]["code"] == "team_has_keys"
    assert (await admin.get(f"/admin/teams/{team['id']}")).status_code == 200  # nothing changed
    bad_flag = await admin.delete(f"/admin/teams/{team['id']}?force=maybe")
    assert bad_flag.status_code == 400 and bad_flag.json()["error"]["param"] == "force"

    forced = await admin.delete(f"/admin/teams/{team['id']}", params={"force": "true"})
    assert forced.status_code == 200, forced.text
    assert sorted(forced.json()["detached_keys"]) == sorted(k["id"] for k in keys)
    for key in keys:
        record = (await admin.get(f"/admin/keys/{key['id']}")).json()
        assert record["team_id"] is None and record["revoked"] is False
    assert (await admin.get(f"/admin/teams/{team['id']}")).status_code == 404


async def test_usage_by_team_and_a_moved_key_keeps_its_history(admin: httpx.AsyncClient, make_access: Any) -> None:
    """A key's requests count for the key and for the team it is in at the time; moving it to another team keeps
    its own history whole, and the first team keeps what the key spent while in it."""
    search, ads = await _team(admin, name="search"), await _team(admin, name="ads")
    key = await _key(admin, name="mover", team_id=search["id"])
    loner = await _key(admin, name="loner")
    access = await make_access()
    for model, prompt, completion in [("m1", 10, 5), ("m2", 3, 1)]:
        admission = await access.admit(key["key"], model=model, estimated_tokens=50)
        await access.settle(admission, SettleUsage(prompt, completion))
    admission = await access.admit(loner["key"], model="m1", estimated_tokens=50)
    await access.settle(admission, SettleUsage(100, 100))

    await admin.patch(f"/admin/keys/{key['id']}", json={"team_id": ads["id"]})
    admission = await access.admit(key["key"], model="m1", estimated_tokens=50)
    await access.settle(admission, SettleUsage(7, 0))

    own = (await admin.get(f"/admin/keys/{key['id']}/usage")).json()["data"]
    assert {r["model"]: (r["requests"], r["total_tokens"]) for r in own} == {"m1": (2, 22), "m2": (1, 4)}
    first = (await admin.get(f"/admin/teams/{search['id']}/usage")).json()
    assert first["team_id"] == search["id"]
    assert {r["model"]: (r["requests"], r["total_tokens"]) for r in first["data"]} == {"m1": (1, 15), "m2": (1, 4)}
    second = (await admin.get(f"/admin/teams/{ads['id']}/usage", params={"days": 1})).json()["data"]
    assert [(r["model"], r["requests"], r["total_tokens"]) for r in second] == [("m1", 1, 7)]

    totals = (await admin.get("/admin/usage", params={"team": search["id"]})).json()
    assert (totals["team_id"], totals["team_name"], totals["requests"], totals["total_tokens"]) == (
        search["id"],
        "search",
        2,
        19,
    )
    assert totals["num_keys"] == 0  # the key has left it; what it spent there stays
    ads_totals = (await admin.get("/admin/usage", params={"team": ads["id"], "days": 30})).json()
    assert (ads_totals["requests"], ads_totals["num_keys"], ads_totals["num_active_keys"]) == (1, 1, 1)
    assert (await admin.get(f"/admin/teams/{search['id']}")).json()["tokens_spent"] == 19

    rows = (await admin.get("/admin/usage/rows", params={"days": 7})).json()["data"]
    assert {(r["key_name"], r["team_name"], r["model"], r["requests"]) for r in rows} == {
        ("mover", "ads", "m1", 2),  # a key's rows carry the team it is in now
        ("mover", "ads", "m2", 1),
        ("loner", None, "m1", 1),
    }
    only_ads = (await admin.get("/admin/usage/rows", params={"team": ads["id"]})).json()["data"]
    assert {(r["key_id"], r["team_id"]) for r in only_ads} == {(key["id"], ads["id"])}
