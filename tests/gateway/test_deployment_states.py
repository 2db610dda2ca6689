"""What an operator sees of a deployment that cannot serve (issue 36): a local model whose `model_path` does not exist
is logged at start-up and shown as `load_failed` with its reason in `/health/ready` and `GET /admin/models`; a
wildcard deployment that is up while some of its models cool down lists those models in `GET /admin/models`.

The production app (`gateway.server.build_app`: real Redis, admin API) with its lifespan running, a fake upstream on
loopback, and the local backend failing its real load (no model is read: the path is missing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.app import AUTH, MASTER
from fakes.upstream import Behavior, FakeUpstream
from starlette.applications import Starlette

from gateway.server import build_app
from gateway.settings import Settings

LOCAL = "local#0"
WILDCARD = "openai/*#0"


def gateway(redis_url: str, directory: Path, upstream: FakeUpstream) -> Starlette:
    routing = directory / "unigate.yaml"
    models = [
        {"id": "local", "deployments": [{"type": "local", "model_path": str(directory / "no-such-model")}]},
        {"id": "openai/*", "deployments": [{"type": "openai", "base_url": upstream.base_url, "api_key": "sk-up"}]},
    ]
    routing.write_text(yaml.safe_dump({"models": models, "router": {"retry_backoff_s": 0.001}}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=directory / "data",
        health_probe_interval_s=0,
        engine={"device": "cpu"},  # type: ignore[arg-type]
    )
    return build_app(settings)


@asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            yield client


async def ready_once_loaded(client: httpx.AsyncClient) -> httpx.Response:
    """`/health/ready` once the local deployment is past `loading` (its load runs in a thread)."""
    async with asyncio.timeout(120):
        while True:
            response = await client.get("/health/ready")
            if response.json()["deployments"][LOCAL] != "loading":
                return response
            await asyncio.sleep(0.05)


def deployment_of(models: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for model in models["data"] for d in model["deployments"] if d["name"] == name)


async def test_a_missing_model_path_is_logged_and_shown_as_load_failed(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    app = gateway(redis_url, tmp_path, fake_upstream)
    missing = str(tmp_path / "no-such-model")
    with caplog.at_level(logging.ERROR):
        async with serving(app) as client:
            ready = await ready_once_loaded(client)
            models = (await client.get("/admin/models", headers=AUTH)).json()
            engine = (await client.get("/admin/engine", headers=AUTH)).json()
            chat = {"model": "local", "messages": [{"role": "user", "content": "hi"}]}
            answer = await client.post("/v1/chat/completions", json=chat, headers=AUTH)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name == "unigate.engine"]
    assert len(errors) == 1 and LOCAL in errors[0] and missing in errors[0] and "checkpoint_not_found" in errors[0]
    # Readiness: the state and its reason; the rule is unchanged (the wildcard deployment is up: 200).
    assert ready.status_code == 200
    assert ready.json()["deployments"] == {LOCAL: "load_failed", WILDCARD: "up"}
    assert ready.json()["reasons"] == {LOCAL: "checkpoint_not_found"}
    local = deployment_of(models, LOCAL)
    assert (local["state"], local["state_reason"]) == ("load_failed", "checkpoint_not_found")
    assert engine["data"][0]["load_error"] == "checkpoint_not_found"
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "checkpoint_not_found"


async def test_no_deployment_up_is_not_ready(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> None:
    """The rule /health/ready keeps: 200 when a deployment is up (or none is configured), so a gateway whose only
    deployment failed to load is 503, with the reason."""
    routing = tmp_path / "unigate.yaml"
    model = {"id": "local", "deployments": [{"type": "local", "model_path": str(tmp_path / "gone")}]}
    routing.write_text(yaml.safe_dump({"models": [model]}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        config=routing,
        master_key=MASTER,  # type: ignore[arg-type]
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
    )
    async with serving(build_app(settings)) as client:
        ready = await ready_once_loaded(client)
    assert ready.status_code == 503
    assert ready.json() == {
        "status": "unavailable",
        "redis": "ok",
        "deployments": {LOCAL: "load_failed"},
        "reasons": {LOCAL: "checkpoint_not_found"},
    }


async def test_a_wildcard_deployment_lists_its_cooling_models(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    app = gateway(redis_url, tmp_path, fake_upstream)
    async with serving(app) as client:
        fake_upstream.queue(*[Behavior(mode="status", status=500)] * 3)  # one request's 3 attempts: gpt-x cools
        chat = {"model": "openai/gpt-x", "messages": [{"role": "user", "content": "hi"}]}
        failed = await client.post("/v1/chat/completions", json=chat, headers=AUTH)
        served = await client.post("/v1/chat/completions", json={**chat, "model": "openai/gpt-y"}, headers=AUTH)
        models = (await client.get("/admin/models", headers=AUTH)).json()
    assert failed.status_code == 502 and served.status_code == 200
    wildcard = deployment_of(models, WILDCARD)
    assert wildcard["state"] == "up" and wildcard["state_reason"] is None
    assert wildcard["num_cooling_models"] == 1
    [cooling] = wildcard["cooling_models"]
    assert cooling["model"] == "openai/gpt-x" and 0 < cooling["cooldown_remaining_s"] <= 30
    assert cooling["cooldown_until"].endswith("Z")


async def test_cooling_models_are_counted_and_the_first_20_listed(
    redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    app = gateway(redis_url, tmp_path, fake_upstream)
    names = [f"openai/m{i:02d}" for i in range(21)]
    async with serving(app) as client:
        for name in reversed(names):
            fake_upstream.queue(*[Behavior(mode="status", status=500)] * 3)
            chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
            assert (await client.post("/v1/chat/completions", json=chat, headers=AUTH)).status_code == 502
        models = (await client.get("/admin/models", headers=AUTH)).json()
    wildcard = deployment_of(models, WILDCARD)
    assert wildcard["state"] == "up" and wildcard["num_cooling_models"] == 21
    assert [m["model"] for m in wildcard["cooling_models"]] == names[:20]  # by name
