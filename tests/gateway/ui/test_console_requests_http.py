"""The console's Requests page over HTTP, without a browser: the production app (`build_app`: real Redis, the
request log on) in-process, with a fake upstream. The page's script is served like the others; its calls to
`/admin/requests` (list with filters and cursor, the live tail, one record) work with the session cookie alone and
not without it; the records it shows never hold the prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.app import MASTER
from fakes.upstream import FakeUpstream
from starlette.applications import Starlette

from gateway.routes.ui import SECURITY_HEADERS
from gateway.server import build_app
from gateway.settings import Settings

SECRET_PROMPT = "the vault opens with 4711 walrus"
ORIGIN = "http://console.test"


@pytest.fixture
def app(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[Starlette]:
    routing = tmp_path / "unigate.yaml"
    deployment = {"type": "openai", "name": "up", "base_url": fake_upstream.base_url, "api_key": "sk-up-SECRET-1"}
    routing.write_text(yaml.safe_dump({"models": [{"id": "gpt-test", "deployments": [deployment]}]}))
    yield build_app(
        Settings(
            _env_file=None,  # type: ignore[call-arg]
            config=routing,
            master_key=MASTER,
            redis_url=redis_url,
            data_dir=tmp_path / "data",
            health_probe_interval_s=0,
            engine={"enabled": False},  # type: ignore[arg-type]
        )
    )


@asynccontextmanager
async def browser(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """A client with a cookie jar, like a browser tab on the console's origin (lifespan running)."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=ORIGIN) as client:
            yield client


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


async def chat(client: httpx.AsyncClient, key: str) -> httpx.Response:
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    return await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


async def listed(client: httpx.AsyncClient, num: int, **params: Any) -> dict[str, Any]:
    """GET /admin/requests with the session cookie, until `num` records are in (the writer batches: a bounded
    wait, never a timed assertion)."""
    body: dict[str, Any] = {}
    for _ in range(400):
        response = await client.get("/admin/requests", params=params)
        assert response.status_code == 200, response.text
        body = response.json()
        if len(body["data"]) >= num:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {num} records for {params}: {body}")


async def test_the_requests_page_and_its_api_over_a_console_session(app: Starlette) -> None:
    async with browser(app) as client:
        page = (await client.get("/ui")).text
        assert '<a href="#/requests" data-page="requests">Requests</a>' in page
        assert '<script src="/ui/static/requests.js" defer>' in page
        script = await client.get("/ui/static/requests.js")
        assert script.status_code == 200 and "UG.pages.requests" in script.text
        for name, value in SECURITY_HEADERS.items():
            assert script.headers[name] == value

        refused = await client.get("/admin/requests")  # no cookie, no key
        assert refused.status_code == 401
        assert (await client.get("/admin/requests/anything")).status_code == 401

        csrf = (await client.post("/ui/api/login", json={"master_key": MASTER})).json()["csrf_token"]
        ours = {"x-csrf-token": csrf, "origin": ORIGIN}
        key = (await client.post("/admin/keys", json={"name": "reader", "rpm": 1}, headers=ours)).json()
        other = (await client.post("/admin/keys", json={"name": "other"}, headers=ours)).json()
        ok = await chat(client, key["key"])
        limited = await chat(client, key["key"])
        elsewhere = await chat(client, other["key"])
        assert (ok.status_code, limited.status_code, elsewhere.status_code) == (200, 429, 200)

        # The page's listing: the key's records newest first, the 429 by status, then by code.
        mine = await listed(client, 2, key=key["id"], limit=50)
        assert [r["request_id"] for r in mine["data"]] == [limited.headers["x-request-id"], ok.headers["x-request-id"]]
        assert mine["next_cursor"] is None and mine["num_dropped"] == 0
        first, second = mine["data"][1], mine["data"][0]
        assert (first["status"], first["deployment"], first["key_name"]) == (200, "up", "reader")
        assert [(a["deployment"], a["status"]) for a in first["attempts"]] == [("up", 200)]
        assert (second["status"], second["attempts"]) == (429, [])
        only_429 = await listed(client, 1, status=429)
        assert [r["request_id"] for r in only_429["data"]] == [limited.headers["x-request-id"]]
        by_code = await listed(client, 1, code=second["code"], key=key["id"])
        assert [r["request_id"] for r in by_code["data"]] == [limited.headers["x-request-id"]]
        by_deployment = await listed(client, 2, deployment="up", model="gpt-test")
        assert {r["request_id"] for r in by_deployment["data"]} == {
            ok.headers["x-request-id"],
            elsewhere.headers["x-request-id"],
        }
        # "Load more": a page of one, then the cursor to the next.
        one = await listed(client, 1, key=key["id"], limit=1)
        assert one["next_cursor"]
        rest = await listed(client, 1, key=key["id"], limit=1, cursor=one["next_cursor"])
        assert [r["request_id"] for r in rest["data"]] == [ok.headers["x-request-id"]]
        # The time range the page sends: RFC 3339 with a zone.
        since = first["time"]
        ranged = await listed(client, 1, since=since, key=key["id"])
        assert ok.headers["x-request-id"] in {r["request_id"] for r in ranged["data"]}
        bad = await client.get("/admin/requests", params={"status": "teapot"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"

        # The detail view, and an unknown id.
        detail = await client.get(f"/admin/requests/{ok.headers['x-request-id']}")
        assert detail.status_code == 200 and detail.json() == first
        unknown = await client.get("/admin/requests/req_unknown")
        assert unknown.status_code == 404 and error_code(unknown) == "request_not_found"

        # The live tail: a position now, then the records after it.
        position = (await client.get("/admin/requests", params={"after": "now"})).json()["position"]
        late = await chat(client, other["key"])
        tail: list[dict[str, Any]] = []
        for _ in range(400):
            answer = (await client.get("/admin/requests", params={"after": position})).json()
            tail += answer["data"]
            position = answer["position"]
            if tail:
                break
            await asyncio.sleep(0.05)
        assert [r["request_id"] for r in tail] == [late.headers["x-request-id"]]

        everything = str((await client.get("/admin/requests", params={"limit": 500})).json())
        assert "vault" not in everything and "walrus" not in everything and "SECRET" not in everything
