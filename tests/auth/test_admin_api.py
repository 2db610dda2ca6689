"""Key lifecycle through the admin routes (inline Starlette app, real Redis)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from auth.base import SettleUsage
from auth.keys import hash_key
from auth.store import KeyStore


async def _create(admin: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await admin.post("/admin/keys", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_create_returns_record_and_secret_once(admin: httpx.AsyncClient) -> None:
    body = {
        "name": "search-team",
        "models": ["openai/*", "local"],
        "rpm": 60,
        "tpm": 10000,
        "max_concurrent": 4,
        "token_budget": 1_000_000,
        "expires_at": "2099-01-01T00:00:00Z",
        "metadata": {"owner": "ana"},
    }
    created = await _create(admin, **body)
    secret = created["key"]
    assert secret.startswith("sk-ug-")
    assert created["key_prefix"] == secret[:10] + "…"
    for name, value in body.items():
        assert created[name] == value, name
    assert created["revoked"] is False and created["tokens_spent"] == 0
    assert created["created_at"].endswith("Z")

    shown = (await admin.get(f"/admin/keys/{created['id']}")).json()
    assert "key" not in shown and "key_hash" not in shown
    assert secret not in str(shown) and hash_key(secret) not in str(shown)
    assert shown["name"] == "search-team"


async def test_defaults_are_unlimited(admin: httpx.AsyncClient) -> None:
    created = await _create(admin)
    assert created["models"] == [] and created["name"] == ""
    assert [created[f] for f in ("rpm", "tpm", "max_concurrent", "token_budget", "expires_at")] == [None] * 5


async def test_list_is_paginated_and_never_shows_secrets(admin: httpx.AsyncClient) -> None:
    secrets_ = [(await _create(admin, name=f"k{i}"))["key"] for i in range(5)]
    page1 = (await admin.get("/admin/keys", params={"limit": 2})).json()
    assert [k["name"] for k in page1["data"]] == ["k0", "k1"] and page1["has_more"] is True
    page2 = (await admin.get("/admin/keys", params={"limit": 2, "after": page1["last_id"]})).json()
    page3 = (await admin.get("/admin/keys", params={"limit": 2, "after": page2["last_id"]})).json()
    assert [k["name"] for k in page2["data"] + page3["data"]] == ["k2", "k3", "k4"]
    assert page3["has_more"] is False
    listing = str(page1) + str(page2) + str(page3)
    assert not any(secret in listing for secret in secrets_)
    bad = await admin.get("/admin/keys", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


async def test_search_pages_through_every_key_not_only_one_page(admin: httpx.AsyncClient) -> None:
    """`search` matches name, id or display prefix, case-insensitively, over all keys; paging with `after` = the
    previous page's `last_id` yields exactly what filtering the whole list would."""
    created = [await _create(admin, name=f"{'Team-A' if i % 3 == 0 else 'other'}-{i}") for i in range(10)]
    expected = [k["id"] for k in created if "team-a" in k["name"].lower()]  # 4 keys, spread over the list

    async def pages(search: str, limit: int) -> list[str]:
        got: list[str] = []
        after: str | None = None
        for _ in range(20):
            params: dict[str, Any] = {"search": search, "limit": limit, **({"after": after} if after else {})}
            page = (await admin.get("/admin/keys", params=params)).json()
            got += [k["id"] for k in page["data"]]
            if not page["has_more"]:
                return got
            after = page["last_id"]
        raise AssertionError("paging did not end")

    assert await pages("TEAM-a", 3) == expected
    assert await pages("team-a", 1) == expected
    assert await pages(created[4]["id"], 2) == [created[4]["id"]]
    prefix = created[7]["key_prefix"]  # 4 random characters: another key may share them, so filter the same way
    assert await pages(prefix, 5) == [k["id"] for k in created if prefix.lower() in k["key_prefix"].lower()]
    empty = (await admin.get("/admin/keys", params={"search": "no-such-key"})).json()
    assert empty["data"] == [] and empty["has_more"] is False


async def test_patch_changes_only_sent_fields_and_null_clears(admin: httpx.AsyncClient) -> None:
    created = await _create(admin, name="a", rpm=10, tpm=100, models=["x"])
    patched = await admin.patch(f"/admin/keys/{created['id']}", json={"rpm": 20, "tpm": None, "models": ["y", "z*"]})
    assert patched.status_code == 200, patched.text
    record = patched.json()
    assert (record["name"], record["rpm"], record["tpm"], record["models"]) == ("a", 20, None, ["y", "z*"])
    null_name = await admin.patch(f"/admin/keys/{created['id']}", json={"name": None})
    assert null_name.status_code == 400 and null_name.json()["error"]["param"] == "name"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rpm": -1}, "rpm"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"models": ["gpt-[45]"]}, "models"),
        ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"expires_at": "2099-01-01T00:00:00"}, "expires_at"),  # RFC 3339 needs an offset
        ({"budget_period": "week"}, "budget_period"),
        ({"unknown": 1}, "unknown"),
        ({"rpm": True}, "rpm"),  # not coerced to a limit of 1
        ({"tpm": 2**64}, "tpm"),  # over 2^53: not exact in Redis's Lua, and beyond what the record can be read back as
        ({"token_budget": 2**53 + 1}, "token_budget"),
        ({"tpm": "60"}, "tpm"),
        ({"max_concurrent": 2.0}, "max_concurrent"),
        ({"token_budget": 1e3}, "token_budget"),
        ({"budget_usd": True}, "budget_usd"),
        ({"name": "ops\r\nX-Injected: 1"}, "name"),
        ({"name": "nul\u0000"}, "name"),
        ({"models": ["gpt\n4"]}, "models"),
        ({"weight": 0}, "weight"),
        ({"weight": "2"}, "weight"),
        ({"priority": "urgent"}, "priority"),
        ({"team_id": "search"}, "team_id"),  # not a team id (an unknown well-formed one is 404 team_not_found)
        ({"team_id": 5}, "team_id"),
    ],
)
async def test_invalid_bodies_name_the_field(admin: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    response = await admin.post("/admin/keys", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if body == {"expires_at": "2001-01-01T00:00:00Z"}:
        return  # an update may set a past expiry: it ends the key now
    created = (await admin.post("/admin/keys", json={})).json()
    response = await admin.patch(f"/admin/keys/{created['id']}", json=body)  # the same rules on update
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_malformed_json_is_400(admin: httpx.AsyncClient) -> None:
    response = await admin.post("/admin/keys", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


async def test_rotate_keeps_id_and_settings_and_revoke_marks_revoked(admin: httpx.AsyncClient) -> None:
    created = await _create(admin, name="svc", rpm=5)
    rotated = (await admin.post(f"/admin/keys/{created['id']}/rotate")).json()
    assert rotated["id"] == created["id"] and rotated["rpm"] == 5 and rotated["rotated_at"] is not None
    assert rotated["key"] != created["key"] and rotated["key_prefix"] == rotated["key"][:10] + "…"
    revoked = await admin.delete(f"/admin/keys/{created['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    again = await admin.post(f"/admin/keys/{created['id']}/rotate")
    assert again.status_code == 400 and again.json()["error"]["code"] == "key_revoked"


async def test_unknown_ids_are_404(admin: httpx.AsyncClient) -> None:
    for method, path in [
        ("GET", "/admin/keys/key_0000000000000000"),
        ("PATCH", "/admin/keys/key_0000000000000000"),
        ("DELETE", "/admin/keys/nope"),
        ("POST", "/admin/keys/master/rotate"),
        ("GET", "/admin/keys/key_0000000000000000/usage"),
    ]:
        response = await admin.request(method, path, json={"rpm": 1} if method == "PATCH" else None)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "key_not_found"


async def test_admin_needs_the_master_key(admin: httpx.AsyncClient) -> None:
    normal = (await _create(admin))["key"]
    base = {"transport": admin._transport, "base_url": "http://gateway"}
    async with httpx.AsyncClient(**base) as anonymous:  # type: ignore[arg-type]
        missing = await anonymous.get("/admin/keys")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        wrong = await anonymous.get("/admin/keys", headers={"authorization": "Bearer sk-ug-not-a-key"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        forbidden = await anonymous.get("/admin/keys", headers={"authorization": f"Bearer {normal}"})
        assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "admin_only"
        anthropic_style = await anonymous.post("/admin/keys", headers={"x-api-key": normal}, json={})
        assert anthropic_style.status_code == 403


async def test_usage_per_model_per_day_and_totals(admin: httpx.AsyncClient, make_access: Any, store: KeyStore) -> None:
    created = await _create(admin, name="u")
    access = await make_access()
    for model, prompt, completion in [("m1", 10, 5), ("m1", 1, 2), ("m2", 7, 0)]:
        admission = await access.admit(created["key"], model=model, estimated_tokens=50)
        await access.settle(admission, SettleUsage(prompt, completion))
    master = await access.admit("sk-ug-master-test-key-0123456789", model="m2", estimated_tokens=0)
    await access.settle(master, SettleUsage(100, 100))

    usage = (await admin.get(f"/admin/keys/{created['id']}/usage")).json()
    rows = {row["model"]: row for row in usage["data"]}
    today = rows["m1"]["date"]
    assert len(today) == 10 and rows["m2"]["date"] == today
    assert (rows["m1"]["requests"], rows["m1"]["prompt_tokens"], rows["m1"]["completion_tokens"]) == (2, 11, 7)
    assert (rows["m2"]["requests"], rows["m2"]["total_tokens"]) == (1, 7)
    assert (await admin.get(f"/admin/keys/{created['id']}/usage", params={"days": 1})).json() == usage

    record = (await admin.get(f"/admin/keys/{created['id']}")).json()
    assert (record["num_requests"], record["tokens_spent"]) == (3, 25)
    totals = (await admin.get("/admin/usage")).json()
    assert (totals["requests"], totals["total_tokens"], totals["num_keys"]) == (4, 225, 1)
    assert {row["model"]: row["requests"] for row in totals["by_model"]} == {"m1": 2, "m2": 2}


async def test_usage_of_many_keys_equals_each_keys_usage(
    admin: httpx.AsyncClient, make_access: Any, store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KeyStore.usage_many` (what /admin/usage/rows reads, in a few pipelined round trips) against the reference,
    `usage` key by key: keys with usage on several models, one with none, the master key and an unknown id, with
    batches of 3 commands so that the replies span several round trips."""
    import auth.store

    monkeypatch.setattr(auth.store, "_PIPELINE_BATCH", 3)
    access = await make_access()
    ids = []
    for i, models in enumerate([["m1", "m2", "m1"], ["m3"], [], ["m2"] * 4]):
        created = await _create(admin, name=f"many-{i}")
        ids.append(created["id"])
        for j, model in enumerate(models):
            admission = await access.admit(created["key"], model=model, estimated_tokens=20)
            await access.settle(admission, SettleUsage(3 + j, 2 * j))
    master = await access.admit("sk-ug-master-test-key-0123456789", model="m9", estimated_tokens=0)
    await access.settle(master, SettleUsage(4, 4))
    wanted = [*ids, "master", "k_unknown00000000000000"]
    for num_days in (None, 1, 30):
        many = await store.usage_many(wanted, num_days=num_days)
        assert list(many) == wanted and many["k_unknown00000000000000"] == []
        for key_id in wanted[:-1]:
            assert many[key_id] == await store.usage(key_id, num_days=num_days), (key_id, num_days)
    assert [len((await store.usage_many(wanted))[key_id]) for key_id in wanted] == [2, 1, 0, 1, 1, 0]

    rows = (await admin.get("/admin/usage/rows", params={"days": 7})).json()["data"]
    assert {(row["key_name"], row["model"], row["requests"]) for row in rows} == {
        ("many-0", "m1", 2),
        ("many-0", "m2", 1),
        ("many-1", "m3", 1),
        ("many-3", "m2", 4),
        ("master key", "m9", 1),
    }


async def test_no_plaintext_secret_anywhere_in_redis(admin: httpx.AsyncClient, make_access: Any, redis: Redis) -> None:
    secrets_ = []
    for i in range(3):
        created = await _create(admin, name=f"s{i}", rpm=100, tpm=100000, max_concurrent=3, token_budget=10**6)
        secrets_.append(created["key"])
    rotated = (await admin.post(f"/admin/keys/{created['id']}/rotate")).json()
    secrets_.append(rotated["key"])
    access = await make_access()
    for secret in secrets_[:2] + secrets_[3:]:
        admission = await access.admit(secret, model="m", estimated_tokens=10)
        await access.settle(admission, SettleUsage(1, 1))

    dump: list[bytes] = []
    async for name in redis.scan_iter(match="*"):
        dump.append(name)
        kind = (await redis.type(name)).decode()
        if kind == "string":
            dump.append(await redis.get(name))
        elif kind == "hash":
            for field, value in (await redis.hgetall(name)).items():
                dump += [field, value]
        elif kind == "zset":
            dump += await redis.zrange(name, 0, -1)
        elif kind == "list":
            dump += await redis.lrange(name, 0, -1)
    blob = b"\n".join(dump)
    assert len(dump) > 20
    for secret in secrets_:
        assert secret.encode() not in blob
        assert secret.removeprefix("sk-ug-")[4:].encode() not in blob  # not even the part after the display prefix
    assert hash_key(secrets_[3]).encode() in blob  # stored as its hash, the old one's mapping removed
    assert hash_key(secrets_[2]).encode() not in blob
