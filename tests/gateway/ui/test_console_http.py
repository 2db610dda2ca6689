"""The console's HTTP side without a browser: the production app (`build_app`: real Redis, admin API) in-process.

Cookie flags, CSRF and Origin refusal, the login rate limit, the security headers on every /ui response (errors
included), logout and a master-key change ending a session, and the read-only admin endpoints the pages use.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.app import MASTER, asgi_client, single_model
from fakes.app import build_app as build_test_app
from fakes.upstream import Behavior, FakeUpstream
from starlette.applications import Starlette

from auth.scripts import as_text
from gateway.routes.ui import SECURITY_HEADERS, SESSION_COOKIE
from gateway.server import build_app
from gateway.settings import Settings

UPSTREAM_KEY = "sk-upstream-SECRET-123"
CSP = SECURITY_HEADERS["content-security-policy"]


def console_app(redis_url: str, directory: Path, upstream: FakeUpstream, **settings: Any) -> Starlette:
    routing = directory / "unigate.yaml"
    deployment = {"type": "openai", "base_url": upstream.base_url, "api_key": UPSTREAM_KEY, "max_in_flight": 4}
    routing.write_text(
        yaml.safe_dump({"models": [{"id": "gpt-test", "aliases": ["fast"], "deployments": [deployment]}]})
    )
    values: dict[str, Any] = {"master_key": MASTER, "engine": {"enabled": False}, **settings}
    return build_app(
        Settings(
            _env_file=None,  # type: ignore[call-arg]
            config=routing,
            redis_url=redis_url,
            data_dir=directory / "data",
            health_probe_interval_s=0,
            **values,
        )
    )


@pytest.fixture
def app(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[Starlette]:
    yield console_app(redis_url, tmp_path, fake_upstream)


@asynccontextmanager
async def browser(app: Starlette, base_url: str = "http://console.test") -> AsyncIterator[httpx.AsyncClient]:
    """A client with a cookie jar, like a browser tab on the console's origin (lifespan running)."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client:
            yield client


@asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[None]:
    async with app.router.lifespan_context(app):
        yield


async def login(client: httpx.AsyncClient, key: str = MASTER) -> httpx.Response:
    return await client.post("/ui/api/login", json={"master_key": key})


def assert_secured(response: httpx.Response) -> None:
    assert response.headers["content-security-policy"] == CSP
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
    assert response.headers["x-frame-options"] == "DENY"


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}  # the documented envelope
    return str(body["error"]["code"])


async def test_pages_and_errors_under_ui_carry_the_strict_csp(app: Starlette) -> None:
    async with browser(app) as client:
        page = await client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        slash = await client.get("/ui/")  # the page's second route (not a rewrite: no x-unigate-path-normalized)
        assert slash.status_code == 200 and slash.text == page.text
        assert "x-unigate-path-normalized" not in slash.headers
        assert_secured(slash)
        other = await client.get("/ui/keys/")  # /ui/* is never rewritten (docs/gateway.md): a 404 that names /ui
        assert other.status_code == 404 and "open /ui" in other.json()["error"]["message"]
        assert_secured(other)
        assert '<script src="/ui/static/app.js" defer>' in page.text and "<script>" not in page.text
        assert_secured(page)
        script = await client.get("/ui/static/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert_secured(script)
        again = await client.get("/ui/static/app.js", headers={"if-none-match": script.headers["etag"]})
        assert again.status_code == 304
        charts = await client.get("/ui/static/charts.js")  # the bench package's shared chart code
        assert charts.status_code == 200 and "UnigateCharts" in charts.text
        for path in ("/ui/static/missing.js", "/ui/static/..%2Fapp.py", "/ui/static/index.html"):
            missing = await client.get(path)
            assert missing.status_code == 404 and error_code(missing) == "not_found", path
            assert_secured(missing)
        refused = await login(client, "wrong")
        assert refused.status_code == 401 and error_code(refused) == "invalid_api_key"
        assert_secured(refused)
        assert SESSION_COOKIE not in refused.headers.get("set-cookie", "")
        for method, path, allow in (
            ("POST", "/ui", "GET, HEAD"),
            ("DELETE", "/ui/static/app.js", "GET, HEAD"),
            ("GET", "/ui/api/login", "POST"),
            ("PUT", "/ui/api/logout", "POST"),
        ):
            wrong = await client.request(method, path)
            assert wrong.status_code == 405 and error_code(wrong) == "method_not_allowed", (method, path)
            assert wrong.headers["allow"] == allow
            assert_secured(wrong)
        assert (await client.head("/ui")).status_code == 200


async def test_login_sets_an_httponly_strict_cookie_secure_only_over_https(app: Starlette) -> None:
    async with browser(app) as client:
        response = await login(client)
        assert response.status_code == 200
        assert response.json()["object"] == "console_session" and len(response.json()["csrf_token"]) >= 40
        cookie = response.headers["set-cookie"]
        flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
        assert cookie.startswith(f"{SESSION_COOKIE}=") and {"httponly", "samesite", "path", "max-age"} <= flags
        assert "samesite=strict" in cookie.lower() and "path=/" in cookie.lower() and "secure" not in flags
        session = await client.get("/ui/api/session")
        assert session.json()["csrf_token"] == response.json()["csrf_token"]
    async with browser(app, "https://console.test") as client:
        assert "secure" in (await login(client)).headers["set-cookie"].lower().split("; ")


async def test_redis_keeps_only_the_session_hash_with_its_ttl(app: Starlette) -> None:
    async with browser(app) as client:
        await login(client)
        session_id = client.cookies[SESSION_COOKIE]
        server = app.state.key_store.redis  # the app's own client: a single server or a cluster
        names = [as_text(name) async for name in server.scan_iter(match="ug:session:*")]
        assert len(names) == 1 and session_id not in names[0]
        assert session_id.encode() not in await server.get(names[0])
        assert 8 * 3600 - 5 <= await server.ttl(names[0]) <= 8 * 3600


async def test_state_changing_admin_calls_need_the_csrf_token_and_our_origin(app: Starlette) -> None:
    async with browser(app) as client:
        csrf = (await login(client)).json()["csrf_token"]
        listed = await client.get("/admin/keys")  # a read needs the cookie only
        assert listed.status_code == 200 and listed.json()["data"] == []
        for headers in ({}, {"x-csrf-token": "wrong"}, {"x-csrf-token": csrf, "origin": "https://evil.example"}):
            refused = await client.post("/admin/keys", json={"name": "x"}, headers=headers)
            assert refused.status_code == 403 and error_code(refused) == "csrf_failed", headers
        deleted = await client.delete("/admin/keys/key_0000000000000000")
        assert deleted.status_code == 403 and error_code(deleted) == "csrf_failed"
        created = await client.post(
            "/admin/keys", json={"name": "ok"}, headers={"x-csrf-token": csrf, "origin": "http://console.test"}
        )
        assert created.status_code == 201 and created.json()["key"].startswith("sk-ug-")
        logout = await client.post("/ui/api/logout", json={})
        assert logout.status_code == 403 and error_code(logout) == "csrf_failed"
    async with browser(app) as anonymous:
        assert (await anonymous.get("/admin/keys")).status_code == 401  # no cookie, no key: unchanged
        bearer = await anonymous.post("/admin/keys", json={}, headers={"authorization": f"Bearer {MASTER}"})
        assert bearer.status_code == 201  # the master key bearer needs no CSRF token, as before
        anonymous.cookies.set(SESSION_COOKIE, "made-up")
        forged = await anonymous.get("/admin/keys")
        assert forged.status_code == 401 and error_code(forged) == "session_expired"


async def test_login_attempts_are_limited_per_client_address(app: Starlette) -> None:
    async with browser(app) as client:
        for _ in range(10):
            assert (await login(client, "wrong")).status_code == 401
        limited = await login(client)  # even the right key, until the minute is over
        assert limited.status_code == 429 and error_code(limited) == "rate_limit_exceeded"
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        assert_secured(limited)


async def test_logout_ends_the_session_for_every_holder_of_the_cookie(app: Starlette) -> None:
    async with browser(app) as client:
        csrf = (await login(client)).json()["csrf_token"]
        session_id = client.cookies[SESSION_COOKIE]
        out = await client.post("/ui/api/logout", json={}, headers={"x-csrf-token": csrf})
        assert out.status_code == 200 and 'unigate_session=""' in out.headers["set-cookie"]
        assert "max-age=0" in out.headers["set-cookie"].lower()
    async with browser(app) as copy:  # another tab or a stolen copy of the cookie
        copy.cookies.set(SESSION_COOKIE, session_id)
        ended = await copy.get("/ui/api/session")
        assert ended.status_code == 401 and error_code(ended) == "session_expired"
        assert (await copy.get("/admin/keys")).status_code == 401


async def test_a_new_master_key_ends_every_session(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> None:
    """Two instances on one Redis: the session opened with the old key dies where the new key is in force."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = console_app(redis_url, tmp_path / "old", fake_upstream)
    new = console_app(redis_url, tmp_path / "new", fake_upstream, master_key="sk-ug-a-new-master-key")
    async with browser(old) as client, serving(new):
        await login(client)
        assert (await client.get("/admin/keys")).status_code == 200
        moved = httpx.AsyncClient(transport=httpx.ASGITransport(app=new), base_url="http://console.test")
        async with moved:
            moved.cookies.set(SESSION_COOKIE, client.cookies[SESSION_COOKIE])
            for path in ("/ui/api/session", "/admin/keys"):
                ended = await moved.get(path)
                assert ended.status_code == 401 and error_code(ended) == "session_expired", path


async def test_admin_models_shows_hosts_and_state_never_keys(app: Starlette, fake_upstream: FakeUpstream) -> None:
    async with browser(app) as client:
        await login(client)
        fake_upstream.queue(*[Behavior(mode="status", status=500)] * 3)
        client.headers["authorization"] = f"Bearer {MASTER}"
        chat = {"model": "fast", "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 502
        del client.headers["authorization"]
        response = await client.get("/admin/models")
    assert response.status_code == 200
    assert UPSTREAM_KEY not in response.text and "/v1" not in response.text
    (model,) = response.json()["data"]
    assert model["id"] == "gpt-test" and model["aliases"] == ["fast"]
    (deployment,) = model["deployments"]
    assert deployment["host"] == f"127.0.0.1:{fake_upstream.port}" and deployment["max_in_flight"] == 4
    assert deployment["num_attempts"] == deployment["num_errors"] >= 1 and deployment["latency_sum_s"] > 0
    assert deployment["state"] in ("up", "cooling_down") and deployment["num_in_flight"] == 0


async def test_usage_rows_by_day_key_and_model(app: Starlette) -> None:
    admin = {"authorization": f"Bearer {MASTER}"}
    async with browser(app) as client:
        key = (await client.post("/admin/keys", json={"name": "team-a"}, headers=admin)).json()
        chat = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
        for secret in (key["key"], key["key"], MASTER):
            sent = await client.post("/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {secret}"})
            assert sent.status_code == 200
        rows = await _settled_rows(client, admin, num_requests=3)
    by_key = {row["key_id"]: row for row in rows}
    assert by_key[key["id"]]["requests"] == 2 and by_key[key["id"]]["key_name"] == "team-a"
    assert by_key["master"]["requests"] == 1 and by_key["master"]["model"] == "gpt-test"
    assert by_key[key["id"]]["total_tokens"] == 2 * by_key["master"]["total_tokens"] > 0


async def _settled_rows(client: httpx.AsyncClient, admin: dict[str, str], *, num_requests: int) -> list[Any]:
    """Usage is settled just after each response: read until every request is counted (bounded, not timed)."""
    rows: list[Any] = []
    for _ in range(200):
        rows = (await client.get("/admin/usage/rows?days=2", headers=admin)).json()["data"]
        if sum(row["requests"] for row in rows) >= num_requests:
            return rows
        await asyncio.sleep(0.01)
    raise AssertionError(f"usage never reached {num_requests} requests: {rows}")


async def test_the_console_can_be_turned_off(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> None:
    app = console_app(redis_url, tmp_path, fake_upstream, console={"enabled": False})
    async with browser(app) as client:
        assert (await client.get("/ui")).status_code == 404
        assert (await login(client)).status_code == 404


async def test_an_app_without_the_admin_api_serves_the_pages_but_no_login(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_test_app(single_model(fake_upstream))) as client:
        assert (await client.get("/ui")).status_code == 200
        refused = await client.post("/ui/api/login", json={"master_key": MASTER})
        assert refused.status_code == 404 and error_code(refused) == "not_found"
        assert_secured(refused)


async def test_teams_over_a_console_session(app: Starlette) -> None:
    """The Teams page's script is served like the others; its calls need the session's CSRF token as the keys' do,
    and moving a key in and out of a team from the console is a key PATCH."""
    async with browser(app) as client:
        page = (await client.get("/ui")).text
        assert '<a href="#/teams" data-page="teams">Teams</a>' in page
        assert '<script src="/ui/static/teams.js" defer>' in page
        script = await client.get("/ui/static/teams.js")
        assert script.status_code == 200 and "UG.pages.teams" in script.text
        assert_secured(script)
        csrf = (await login(client)).json()["csrf_token"]
        refused = await client.post("/admin/teams", json={"name": "search"})
        assert refused.status_code == 403 and error_code(refused) == "csrf_failed"
        ours = {"x-csrf-token": csrf, "origin": "http://console.test"}
        team = (await client.post("/admin/teams", json={"name": "search", "budget_usd": 5}, headers=ours)).json()
        assert team["object"] == "team" and team["budget_usd"] == 5
        assert [t["id"] for t in (await client.get("/admin/teams")).json()["data"]] == [team["id"]]
        key = (await client.post("/admin/keys", json={"name": "k"}, headers=ours)).json()
        moved = await client.patch(f"/admin/keys/{key['id']}", json={"team_id": team["id"]}, headers=ours)
        assert moved.status_code == 200 and moved.json()["team_id"] == team["id"]
        members = (await client.get(f"/admin/teams/{team['id']}/keys")).json()["data"]
        assert [m["id"] for m in members] == [key["id"]]
        not_forced = await client.delete(f"/admin/teams/{team['id']}", headers=ours)
        assert error_code(not_forced) == "team_has_keys"
        forced = await client.delete(f"/admin/teams/{team['id']}?force=true", headers=ours)
        assert forced.status_code == 200 and forced.json()["detached_keys"] == [key["id"]]
