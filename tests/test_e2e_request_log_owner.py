"""A key owner reads its own key's records with that key (issue 39), through a real gateway on a real Redis: a
listing, the live tail and a lookup keep that key's records; another key's or team's listing is refused (403
admin_only) and another key's record is not found (404, as if it did not exist); the master key still reads all."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.app import MASTER
from fakes.instances import gateway_instances
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

ADMIN = {"authorization": f"Bearer {MASTER}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def gateway(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Iterator[ThreadedServer]:
    models = [{"id": "m", "deployments": [{"type": "openai", "base_url": fake_upstream.base_url}]}]
    with gateway_instances(redis_url, tmp_path, models, names=("a",)) as (server,):
        yield server


async def admin_post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(url, json=body, headers=ADMIN)
    assert response.status_code in (200, 201), response.text
    created: dict[str, Any] = response.json()
    return created


async def send(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """A chat request's id, once its record is in the log (the writer works in the background)."""
    response = await client.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    for _ in range(200):
        if (await client.get(f"{url}/admin/requests/{request_id}", headers=ADMIN)).status_code == 200:
            return request_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record for {request_id}")


def ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [record["request_id"] for record in response.json()["data"]]


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]


async def test_a_key_reads_its_own_records_and_no_one_elses(gateway: ThreadedServer) -> None:
    url = gateway.url
    async with httpx.AsyncClient(timeout=30) as client:
        team = await admin_post(client, f"{url}/admin/teams", {"name": "research"})
        other_team = await admin_post(client, f"{url}/admin/teams", {"name": "ops"})
        mine = await admin_post(client, f"{url}/admin/keys", {"name": "mine", "team_id": team["id"]})
        teammate = await admin_post(client, f"{url}/admin/keys", {"name": "teammate", "team_id": team["id"]})
        me = {"authorization": f"Bearer {mine['key']}"}
        them = {"authorization": f"Bearer {teammate['key']}"}

        first = await send(client, url, me)
        theirs = await send(client, url, them)
        masters = await send(client, url, ADMIN)
        second = await send(client, url, me)

        assert ids(await client.get(f"{url}/admin/requests", headers=me)) == [second, first]
        assert ids(await client.get(f"{url}/admin/requests", params={"key": mine["id"]}, headers=me)) == [
            second,
            first,
        ]
        # the key's own team narrows nothing it could not see: still only its own records, not its teammate's
        assert ids(await client.get(f"{url}/admin/requests", params={"team": team["id"]}, headers=me)) == [
            second,
            first,
        ]
        assert ids(await client.get(f"{url}/admin/requests", params={"limit": 1}, headers=me)) == [second]
        for params in ({"key": teammate["id"]}, {"key": "master"}, {"team": other_team["id"]}):
            assert_refused(await client.get(f"{url}/admin/requests", params=params, headers=me), 403, "admin_only")

        own = await client.get(f"{url}/admin/requests/{first}", headers=me)
        assert own.status_code == 200 and own.json()["key_id"] == mine["id"]
        unknown = await client.get(f"{url}/admin/requests/no-such-request", headers=me)
        assert_refused(unknown, 404, "request_not_found")
        for request_id in (theirs, masters):  # answered exactly as an unknown id is: nothing says it exists
            missing = await client.get(f"{url}/admin/requests/{request_id}", headers=me)
            assert_refused(missing, 404, "request_not_found")
            assert missing.text.replace(request_id, "no-such-request") == unknown.text

        # the live tail: only the key's own new records, and the position moves past the others'
        position = (await client.get(f"{url}/admin/requests", params={"after": "now"}, headers=me)).json()["position"]
        later_theirs = await send(client, url, them)
        later_mine = await send(client, url, me)
        tail = await client.get(f"{url}/admin/requests", params={"after": position}, headers=me)
        assert ids(tail) == [later_mine]
        end = tail.json()["position"]
        assert ids(await client.get(f"{url}/admin/requests", params={"after": end}, headers=me)) == []

        # 14 reads with the key so far, more than the 10 failed admin authentications a minute an address may make
        # (UNIGATE_CONSOLE__MAX_LOGINS_PER_MIN): a key reading its own records is not a guess at the master key
        assert (await client.get(f"{url}/admin/requests", params={"limit": 1}, headers=me)).status_code == 200

        # the master key reads every key's records, as before
        everything = ids(await client.get(f"{url}/admin/requests", headers=ADMIN))
        assert everything == [later_mine, later_theirs, second, masters, theirs, first]
        teammates = await client.get(f"{url}/admin/requests", params={"key": teammate["id"]}, headers=ADMIN)
        assert ids(teammates) == [later_theirs, theirs]
        assert (await client.get(f"{url}/admin/requests/{theirs}", headers=ADMIN)).status_code == 200


async def test_a_key_reads_nothing_else_of_the_admin_api_and_dead_keys_read_nothing(gateway: ThreadedServer) -> None:
    url = gateway.url
    async with httpx.AsyncClient(timeout=30) as client:
        key = await admin_post(client, f"{url}/admin/keys", {"name": "k"})
        headers = {"authorization": f"Bearer {key['key']}"}
        request_id = await send(client, url, headers)
        for path in ("/admin/keys", f"/admin/keys/{key['id']}", "/admin/teams"):
            assert_refused(await client.get(f"{url}{path}", headers=headers), 403, "admin_only")

        assert (await client.delete(f"{url}/admin/keys/{key['id']}", headers=ADMIN)).status_code == 200
        for path in ("/admin/requests", f"/admin/requests/{request_id}"):
            assert_refused(await client.get(f"{url}{path}", headers=headers), 401, "invalid_api_key")
            unknown = {"authorization": "Bearer sk-not-a-key"}
            assert_refused(await client.get(f"{url}{path}", headers=unknown), 401, "invalid_api_key")
            assert (await client.get(f"{url}{path}")).status_code == 401
