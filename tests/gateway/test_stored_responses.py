"""`native_responses` deployments share one upstream key across tenants: stored state (`previous_response_id`,
`conversation`, `store: true`) is refused unless the deployment opts in with `allow_stored_responses: true`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fakes.app import AUTH, asgi_client, build_app, single_model
from fakes.upstream import FakeUpstream

BODY = {"model": "gpt-test", "input": "Hi"}


async def post(upstream: FakeUpstream, body: dict[str, Any], **deployment: Any) -> httpx.Response:
    async with asgi_client(build_app(single_model(upstream, native_responses=True, **deployment))) as client:
        return await client.post("/v1/responses", json=body, headers=AUTH)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_of_another_tenant"}, "previous_response_id"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"conversation": {"id": "conv_123"}}, "conversation"),
        ({"store": True}, "store"),
        ({"store": "yes"}, "store"),
    ],
)
async def test_stored_state_is_refused_by_default(
    fake_upstream: FakeUpstream, fields: dict[str, Any], param: str
) -> None:
    response = await post(fake_upstream, {**BODY, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == param
    assert fake_upstream.requests == []


@pytest.mark.parametrize("store", [None, False])
async def test_stateless_requests_pass_with_store_false(fake_upstream: FakeUpstream, store: bool | None) -> None:
    body = BODY if store is None else {**BODY, "store": store}
    response = await post(fake_upstream, {**body, "previous_response_id": None})
    assert response.status_code == 200, response.text
    [forwarded] = fake_upstream.requests
    assert forwarded.path == "/v1/responses" and forwarded.body["store"] is False


async def test_an_opted_in_deployment_passes_stored_state_through(fake_upstream: FakeUpstream) -> None:
    body = {**BODY, "previous_response_id": "resp_1", "store": True, "conversation": "conv_1"}
    response = await post(fake_upstream, body, allow_stored_responses=True)
    assert response.status_code == 200, response.text
    [forwarded] = fake_upstream.requests
    assert {k: forwarded.body[k] for k in ("previous_response_id", "store", "conversation")} == {
        "previous_response_id": "resp_1",
        "store": True,
        "conversation": "conv_1",
    }
    unset = await post(fake_upstream, BODY, allow_stored_responses=True)
    assert unset.status_code == 200 and "store" not in fake_upstream.requests[-1].body  # the upstream's default


async def test_translated_models_still_refuse_previous_response_id(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post("/v1/responses", json={**BODY, "previous_response_id": "r"}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "previous_response_id"
