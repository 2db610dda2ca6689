"""The app around the pipeline: path tolerance, request ids, models listing, health, metrics, other endpoints."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, CHAT, MASTER, asgi_client, build_app, deployment, make_settings, single_model
from fakes.upstream import FakeUpstream

from gateway.middleware import normalize_path


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/v1/v1/models", "/v1/models"),
        ("/chat/completions", "/v1/chat/completions"),
        ("/embeddings", "/v1/embeddings"),
        ("/messages", "/v1/messages"),
        ("/health/live", "/health/live"),
        ("/metrics", "/metrics"),
        ("/admin/keys", "/admin/keys"),
    ],
)
def test_normalize_path(path: str, served: str) -> None:
    assert normalize_path(path) == served


@pytest.mark.parametrize("path", ["/v1/v1/chat/completions", "/chat/completions"])
async def test_misconfigured_base_urls_are_served_with_a_note(fake_upstream: FakeUpstream, path: str) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post(path, json=CHAT, headers=AUTH)
        assert response.status_code == 200  # served, not redirected
        assert response.headers["x-unigate-path-normalized"] == f"{path} -> /v1/chat/completions"
        normal = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert "x-unigate-path-normalized" not in normal.headers
        models = await client.get("/models", headers=AUTH)
        assert models.status_code == 200 and models.headers["x-unigate-path-normalized"] == "/models -> /v1/models"
    assert [r.path for r in fake_upstream.requests] == ["/v1/chat/completions"] * 2


async def test_request_id_is_echoed_generated_and_forwarded(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        mine = await client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "x-request-id": "req-abc.123"})
        assert mine.headers["x-request-id"] == "req-abc.123"
        generated = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert len(generated.headers["x-request-id"]) == 32
        bogus = await client.get("/health/live", headers={"x-request-id": "has spaces\tand tabs"})
        assert bogus.headers["x-request-id"] != "has spaces\tand tabs"
        failed = await client.post("/v1/chat/completions", json={}, headers=AUTH)
        assert failed.status_code == 400 and failed.headers["x-request-id"]
    assert fake_upstream.requests[0].headers["x-request-id"] == "req-abc.123"


async def test_upstream_sees_rewritten_model_and_its_own_key(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream, model="real-upstream-name"))) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "model": "fast", "top_k": 5}, headers=AUTH)
    assert response.status_code == 200
    sent = fake_upstream.requests[0]
    assert sent.body["model"] == "real-upstream-name"
    assert sent.body["top_k"] == 5  # unknown fields are forwarded untouched
    assert sent.headers["authorization"] == "Bearer sk-upstream-SECRET-123"  # never the caller's key


async def test_rate_limit_headers_from_admission(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.headers["x-ratelimit-remaining-requests"] == "99"


async def test_models_list_only_what_the_key_may_use(fake_upstream: FakeUpstream) -> None:
    access = RecordingAccess(master_key=MASTER, keys={"sk-ug-limited": ("gpt-*",)})
    routing = {
        "models": [
            {"id": "gpt-test", "aliases": ["fast"], "deployments": [deployment(fake_upstream)]},
            {"id": "claude-x", "deployments": [deployment(fake_upstream)]},
            {"id": "openai/*", "deployments": [deployment(fake_upstream)]},
        ]
    }
    async with asgi_client(build_app(routing, access=access)) as client:
        everything = (await client.get("/v1/models", headers=AUTH)).json()
        assert everything["object"] == "list"
        assert [m["id"] for m in everything["data"]] == ["gpt-test", "claude-x", "openai/fake"]  # the upstream's
        assert everything["data"][0]["aliases"] == ["fast"]
        limited_auth = {"authorization": "Bearer sk-ug-limited"}
        limited = (await client.get("/v1/models", headers=limited_auth)).json()
        assert [m["id"] for m in limited["data"]] == ["gpt-test"]
        assert (await client.get("/v1/models/fast", headers=AUTH)).json()["id"] == "gpt-test"
        assert (await client.get("/v1/models/openai/gpt-4.1", headers=AUTH)).json()["id"] == "openai/gpt-4.1"
        hidden = await client.get("/v1/models/claude-x", headers=limited_auth)
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
        denied = await client.post("/v1/chat/completions", json={**CHAT, "model": "claude-x"}, headers=limited_auth)
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
        # close matches never reveal models the key may not use
        typo = await client.post("/v1/chat/completions", json={**CHAT, "model": "claude-y"}, headers=limited_auth)
        assert typo.status_code == 404 and "claude-x" not in typo.text
        assert (await client.get("/v1/models")).status_code == 401


async def test_completions_and_embeddings(fake_upstream: FakeUpstream) -> None:
    access = RecordingAccess(master_key=MASTER)
    async with asgi_client(build_app(single_model(fake_upstream), access=access)) as client:
        completion = await client.post("/v1/completions", json={"model": "fast", "prompt": "Once"}, headers=AUTH)
        assert completion.json()["choices"][0]["text"] == "Hello from the fake upstream"
        embedding = await client.post("/v1/embeddings", json={"model": "fast", "input": ["a", "b"]}, headers=AUTH)
        assert [d["index"] for d in embedding.json()["data"]] == [0, 1]
        missing = await client.post("/v1/completions", json={"model": "fast"}, headers=AUTH)
        assert missing.json()["error"]["param"] == "prompt"
        missing = await client.post("/v1/embeddings", json={"model": "fast", "input": []}, headers=AUTH)
        assert missing.json()["error"]["param"] == "input"
    assert [(s.prompt_tokens, s.completion_tokens) for s in access.settled] == [(7, 3), (7, 0)]


class ChatOnlyBackend:
    name = "gpt-test#0"

    def supports(self, endpoint: str) -> bool:
        return endpoint == "chat/completions"

    async def check_health(self) -> bool:
        return False

    async def aclose(self) -> None:
        return None


async def test_endpoint_the_backend_does_not_serve(fake_upstream: FakeUpstream) -> None:
    app = build_app(single_model(fake_upstream), backends={"gpt-test#0": ChatOnlyBackend()})
    async with asgi_client(app) as client:
        response = await client.post("/v1/embeddings", json={"model": "gpt-test", "input": "x"}, headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_endpoint"


@pytest.mark.parametrize(
    ("redis_up", "redis_state", "status"), [(None, "not_used", 200), (True, "ok", 200), (False, "down", 503)]
)
async def test_health(fake_upstream: FakeUpstream, redis_up: bool | None, redis_state: str, status: int) -> None:
    access = RecordingAccess(master_key=MASTER, is_redis_up=redis_up)
    async with asgi_client(build_app(single_model(fake_upstream), access=access)) as client:
        assert (await client.get("/health/live")).json() == {"status": "ok"}
        ready = await client.get("/health/ready")
    assert ready.status_code == status
    assert ready.json()["redis"] == redis_state
    assert ready.json()["deployments"] == {"gpt-test#0": "up"}


async def test_scheduled_probes_take_unreachable_deployments_out(fake_upstream_factory: Any) -> None:
    up, down = fake_upstream_factory(), fake_upstream_factory()
    down.stop()
    routing = {
        "models": [{"id": "gpt-test", "deployments": [deployment(up, name="up"), deployment(down, name="down")]}]
    }
    app = build_app(routing, health_probe_interval_s=0.01)
    async with asgi_client(app) as client:
        async with asyncio.timeout(30):
            while app.state.health_prober.num_rounds < 1:  # the gateway's own schedule, not the readiness call
                await asyncio.sleep(0.01)
        ready = await client.get("/health/ready")
        assert ready.status_code == 200
        assert ready.json()["deployments"] == {"up": "up", "down": "down"}
        for _ in range(3):  # the down deployment is cooling: traffic avoids it
            assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status_code == 200
    assert [r.method for r in up.requests].count("POST") == 3


async def test_metrics_after_traffic(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=AUTH)
        text = (await client.get("/metrics")).text
    assert 'unigate_requests_total{model="gpt-test",route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'unigate_errors_total{code="model_not_found"} 1.0' in text
    assert 'unigate_tokens_total{direction="in",model="gpt-test"} 7.0' in text
    assert 'unigate_upstream_duration_seconds_count{deployment="gpt-test#0",outcome="ok"} 1.0' in text
    assert "unigate_requests_in_flight" in text and "unigate_time_to_first_token_seconds" in text


async def test_two_apps_in_one_process_do_not_share_metrics(fake_upstream: FakeUpstream) -> None:
    first, second = build_app(single_model(fake_upstream)), build_app(single_model(fake_upstream))
    async with asgi_client(first) as client:
        await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    async with asgi_client(second) as client:
        text = (await client.get("/metrics")).text
    assert 'status="200"} 1.0' not in text.split("unigate_requests_total", 1)[-1].split("#", 1)[0]


class MessagesBackend:
    """A backend that serves Anthropic `messages` natively (as `type: anthropic` will)."""

    name = "gpt-test#0"

    def supports(self, endpoint: str) -> bool:
        return endpoint == "messages"

    async def stream(
        self, endpoint: str, body: Any, *, request_id: str, headers: Any = None, tenancy: Any = None
    ) -> Any:
        yield {"type": "message_start", "message": {"usage": {"input_tokens": 11, "output_tokens": 1}}}
        yield {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "hi"}}
        yield {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 5}}

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


async def test_pipeline_serves_other_families_untouched(fake_upstream: FakeUpstream) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from gateway.app import create_app
    from gateway.call_context import call_context
    from gateway.pipeline import open_call, serves_natively
    from gateway.routing_config import parse_routing

    async def messages(request: Request) -> Response:
        context = await call_context(request)
        body = await request.json()
        assert serves_natively(context.router, body["model"], "messages")
        call = await open_call(context, endpoint="messages", body=body, model=body["model"], stream=True)
        return JSONResponse([event async for event in call.chunks()], headers=call.headers)

    access = RecordingAccess(master_key=MASTER)
    app = create_app(
        make_settings(),
        access=access,
        routing=parse_routing(single_model(fake_upstream), source="t"),
        backends={"gpt-test#0": MessagesBackend()},
        extra_routes=[Route("/v1/messages/_probe", messages, methods=["POST"])],
    )
    async with asgi_client(app) as client:
        response = await client.post("/v1/messages/_probe", json={"model": "fast", "messages": []}, headers=AUTH)
    assert [e["type"] for e in response.json()] == ["message_start", "content_block_delta", "message_delta"]
    assert response.json()[2]["usage"] == {"output_tokens": 5}  # not stripped: not an OpenAI stream
    assert [(s.prompt_tokens, s.completion_tokens) for s in access.settled] == [(11, 5)]
