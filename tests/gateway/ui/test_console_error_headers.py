"""Every `/ui` answer carries the console's security headers, including the errors rendered outside the console's
handlers: the 413 of the body limit (the production gateway on a loopback port), and a 500, 404 and 405 under
`/ui` (the smallest app with the error middleware); API paths keep their plain error envelope."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml
from fakes.app import MASTER
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.metrics import GatewayMetrics
from gateway.middleware import ErrorMiddleware, http_exception_handler
from gateway.routes.ui import SECURITY_HEADERS
from gateway.server import build_app
from gateway.settings import Settings

MAX_BODY_BYTES = 1024


def assert_secured(response: httpx.Response) -> None:
    assert {name: response.headers.get(name) for name in SECURITY_HEADERS} == SECURITY_HEADERS
    assert response.headers["cache-control"] == "no-store"


@pytest.fixture
def gateway(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> ThreadedServer:
    routing = tmp_path / "unigate.yaml"
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-upstream"}
    routing.write_text(yaml.safe_dump({"models": [{"id": "gpt-test", "deployments": [deployment]}]}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER,
        engine={"enabled": False},  # type: ignore[arg-type]
        config=routing,
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
        max_body_bytes=MAX_BODY_BYTES,
    )
    return gateway_server(build_app(settings))


@pytest.mark.parametrize("path", ["/ui/api/login", "/ui/api/logout", "/ui", "/ui/anything"])
def test_a_body_over_the_limit_under_ui_is_a_secured_413(gateway: ThreadedServer, path: str) -> None:
    body = b'{"master_key": "' + b"k" * 4 * MAX_BODY_BYTES + b'"}'
    response = httpx.post(gateway.url + path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert_secured(response)


def test_an_api_413_carries_no_console_headers(gateway: ThreadedServer) -> None:
    response = httpx.post(gateway.url + "/v1/chat/completions", content=b"x" * 4 * MAX_BODY_BYTES)
    assert response.status_code == 413
    assert not {name for name in SECURITY_HEADERS if name in response.headers}


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug")


async def _page(request: Request) -> Response:
    return Response("page")


def _small_app() -> Starlette:
    metrics = GatewayMetrics(model_ids=[])
    return Starlette(
        routes=[Route("/ui/boom", _boom), Route("/ui/page", _page, methods=["GET"]), Route("/v1/boom", _boom)],
        middleware=[Middleware(ErrorMiddleware, metrics=metrics)],
        exception_handlers={HTTPException: http_exception_handler},
    )


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/ui/boom", 500, "internal_error"),
        ("GET", "/ui/missing", 404, "not_found"),
        ("POST", "/ui/page", 405, "method_not_allowed"),
    ],
)
async def test_errors_under_ui_from_outside_the_console_are_secured(
    method: str, path: str, status: int, code: str
) -> None:
    transport = httpx.ASGITransport(app=_small_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.request(method, path)
        assert (response.status_code, response.json()["error"]["code"]) == (status, code)
        assert_secured(response)
        api = await client.get("/v1/boom")
        assert api.status_code == 500 and "content-security-policy" not in api.headers
