"""The typed context a route hands to the pipeline (gateway/call_context.py): the caller verified first, the request
id, the client headers a backend may pass on (short printable ASCII only), and the request's state, where the
resolved model is named for the request metrics."""

from __future__ import annotations

from fakes.access import RecordingAccess
from fakes.app import AUTH, MASTER, asgi_client, make_settings, single_model
from fakes.upstream import FakeUpstream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.app import create_app
from gateway.call_context import call_context
from gateway.routing_config import parse_routing


async def probe(request: Request) -> Response:
    context = await call_context(request)
    context.label_model("gpt-test")
    return JSONResponse(
        {
            "principal": context.principal.name,
            "request_id": context.request_id,
            "forwarded": context.forwarded_headers,
            "model_label": request.scope["state"]["model"],
            "is_app_router": context.router is request.app.state.router,
        }
    )


def probe_app(fake_upstream: FakeUpstream) -> object:
    return create_app(
        make_settings(),
        access=RecordingAccess(master_key=MASTER),
        routing=parse_routing(single_model(fake_upstream), source="t"),
        extra_routes=[Route("/v1/_context", probe, methods=["POST"])],
    )


async def test_the_context_carries_the_verified_caller_and_the_requests_parts(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(probe_app(fake_upstream)) as client:  # type: ignore[arg-type]
        headers = {**AUTH, "x-request-id": "req-7", "anthropic-beta": "tools-2024"}
        response = await client.post("/v1/_context", headers=headers)
    assert response.json() == {
        "principal": "master",
        "request_id": "req-7",
        "forwarded": {"anthropic-beta": "tools-2024"},
        "model_label": "gpt-test",
        "is_app_router": True,
    }


async def test_unprintable_or_long_client_headers_are_not_passed_on(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(probe_app(fake_upstream)) as client:  # type: ignore[arg-type]
        long = await client.post("/v1/_context", headers={**AUTH, "anthropic-beta": "x" * 1025})
        unprintable = await client.post("/v1/_context", headers={**AUTH, "anthropic-beta": "a\tb"})
    assert long.json()["forwarded"] is None and unprintable.json()["forwarded"] is None


async def test_an_unknown_key_is_refused_when_the_context_is_built(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(probe_app(fake_upstream)) as client:  # type: ignore[arg-type]
        unknown = await client.post("/v1/_context", headers={"authorization": "Bearer sk-ug-nope"})
        missing = await client.post("/v1/_context")
    assert [unknown.status_code, missing.status_code] == [401, 401]
    assert missing.json()["error"]["code"] == "missing_api_key"
