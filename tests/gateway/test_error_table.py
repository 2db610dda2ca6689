"""Every row of the error table, through the real app and a real (misbehaving) upstream over loopback."""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any

import httpx
import orjson
import pytest
from fakes.access import RecordingAccess
from fakes.app import AUTH, CHAT, MASTER, asgi_client, build_app, deployment, make_settings, single_model
from fakes.upstream import MALFORMED_VARIANTS, Behavior, FakeUpstream
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth import scripts
from gateway import errors
from gateway.app import create_app
from gateway.routing_config import parse_routing

SECRET = "sk-upstream-SECRET-123"


def assert_envelope(response: httpx.Response, status: int, code: str, *, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["param"] == param
    assert SECRET not in response.text and "127.0.0.1" not in response.text and "Traceback" not in response.text
    assert response.headers["x-request-id"]
    return error  # type: ignore[no-any-return]


async def post(upstream: FakeUpstream, body: Any = None, headers: Any = None, **request: Any) -> httpx.Response:
    app = build_app(single_model(upstream, router={"num_retries": 0}))
    async with asgi_client(app) as client:
        return await client.post("/v1/chat/completions", json=body or CHAT, headers=headers or AUTH, **request)


@pytest.mark.parametrize(
    ("headers", "code", "says"),
    [
        ({}, "missing_api_key", "No API key"),
        ({"authorization": MASTER}, "invalid_auth_header", "no 'Bearer ' prefix"),
        ({"authorization": "Bearer "}, "invalid_auth_header", "followed by no key"),
        ({"authorization": "Bearer sk-proj-abcdef"}, "invalid_api_key", "start with 'sk-ug-'"),
        ({"authorization": "Bearer sk-ug-nope"}, "invalid_api_key", "no such key"),
    ],
)
async def test_auth_failures_say_which(
    fake_upstream: FakeUpstream, headers: dict[str, str], code: str, says: str
) -> None:
    error = assert_envelope(await post(fake_upstream, headers=headers or {"x-other": "1"}), 401, code)
    assert says in error["message"]
    assert fake_upstream.requests == []


async def test_unknown_model_lists_close_matches(fake_upstream: FakeUpstream) -> None:
    response = await post(fake_upstream, {**CHAT, "model": "gpt-tset"})
    error = assert_envelope(response, 404, "model_not_found", param="model")
    assert "'gpt-test'" in error["message"]


async def test_unknown_model_with_bad_key_is_401_not_404(fake_upstream: FakeUpstream) -> None:
    response = await post(fake_upstream, {**CHAT, "model": "nope"}, headers={"authorization": "Bearer sk-ug-bad"})
    assert_envelope(response, 401, "invalid_api_key")


async def test_invalid_json_gives_position(fake_upstream: FakeUpstream) -> None:
    response = await post(fake_upstream, headers={**AUTH, "content-type": "application/json"}, content=b'{"model": }')
    error = assert_envelope(response, 400, "invalid_json")
    assert "line 1, column 11" in error["message"] and "character 10" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "model": 42}, "model"),
        ({**CHAT, "model": "gpt-test" + "x" * 300}, "model"),  # over 256 characters: never forwarded nor recorded
        ({"model": "gpt-test"}, "messages"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": "hi"}, "messages"),
        ({**CHAT, "messages": [{"content": "no role"}]}, "messages[0].role"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "messages": [{"role": "bogus", "content": "hi"}]}, "messages[0].role"),
        ({**CHAT, "messages": [{"role": "", "content": "hi"}]}, "messages[0].role"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
            "messages[0].content[0].text",
        ),
        ({**CHAT, "messages": [{"role": "assistant", "tool_calls": "garbage"}]}, "messages[0].tool_calls"),
        ({**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]}, "messages[0].tool_calls[0]"),
        (
            {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
async def test_invalid_fields_name_the_param(fake_upstream: FakeUpstream, body: dict[str, Any], param: str) -> None:
    assert_envelope(await post(fake_upstream, body), 400, "invalid_request", param=param)
    assert fake_upstream.requests == []


async def test_non_object_body(fake_upstream: FakeUpstream) -> None:
    assert_envelope(await post(fake_upstream, [1, 2]), 400, "invalid_json")


async def test_body_over_limit_is_413(fake_upstream: FakeUpstream) -> None:
    app = build_app(single_model(fake_upstream), max_body_bytes=1000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    async with asgi_client(app) as client:
        assert_envelope(await client.post("/v1/chat/completions", json=big, headers=AUTH), 413, "body_too_large")

        # without Content-Length (chunked upload) the limit holds while reading
        async def chunks() -> Any:
            for _ in range(5):
                yield b"x" * 400

        response = await client.post("/v1/chat/completions", content=chunks(), headers=AUTH)
        assert_envelope(response, 413, "body_too_large")


@pytest.mark.parametrize(
    ("behavior", "status", "code"),
    [
        (Behavior(mode="status", status=401), 502, "upstream_auth_failed"),
        (Behavior(mode="status", status=403), 502, "upstream_auth_failed"),
        (Behavior(mode="status", status=500), 502, "upstream_error"),
        (Behavior(mode="status", status=503), 502, "upstream_error"),
        (Behavior(mode="status", status=404), 404, "model_not_found"),
        (Behavior(mode="status", status=404, variant="model_not_found"), 404, "model_not_found"),
        (Behavior(mode="status", status=400), 400, "invalid_request"),
        (Behavior(mode="status", status=400, variant="context_length_exceeded"), 400, "context_length_exceeded"),
        (Behavior(mode="status", status=400, variant="invalid_api_key"), 502, "upstream_auth_failed"),
        (Behavior(mode="status", status=400, variant="google:API_KEY_INVALID"), 502, "upstream_auth_failed"),
        (Behavior(mode="status", status=529, variant="anthropic:overloaded_error"), 503, "upstream_overloaded"),
        (Behavior(mode="status", status=503, variant="anthropic:overloaded_error"), 503, "upstream_overloaded"),
        (Behavior(mode="drop"), 502, "upstream_error"),
        (Behavior(mode="html"), 502, "upstream_malformed_response"),
    ],
)
async def test_upstream_failures_map_to_codes(
    fake_upstream: FakeUpstream, behavior: Behavior, status: int, code: str
) -> None:
    fake_upstream.behave(behavior)
    error = assert_envelope(await post(fake_upstream), status, code, param="model" if status == 404 else None)
    assert error["type"] == TYPE_OF_STATUS[status]  # docs/gateway.md: "the `type` of each status"
    if code == "upstream_auth_failed":
        assert "not about your API key" in error["message"]
    if behavior.mode == "html":
        assert "HTML" in error["message"]


# docs/gateway.md, errors: "The `type` of each status".
TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "service_unavailable",
    504: "api_error",
}


def all_error_classes() -> list[type[errors.GatewayError]]:
    found: list[type[errors.GatewayError]] = []
    pending: list[type[errors.GatewayError]] = [errors.GatewayError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def test_every_503_is_service_unavailable_whatever_the_class() -> None:
    """The rule "status 503 ⇒ type service_unavailable" for every error class: its own status, and a 503 passed in
    (an upstream's 529, an Anthropic `overloaded_error` event, an engine process's 503)."""
    classes = all_error_classes()
    assert {errors.UpstreamOverloadedError, errors.EngineLoadingError, scripts.StorageError} <= set(classes)
    for cls in classes:
        if "status_code" not in inspect.signature(cls).parameters:
            assert cls.status_code != 503, cls  # (auth.scripts.ScriptError: always 500 internal_error)
            continue
        if cls.status_code == 503:
            assert cls("x").type == "service_unavailable", cls
        assert cls("x", status_code=503).type == "service_unavailable", cls
        assert cls("x", status_code=503).to_dict()["error"]["type"] == "service_unavailable", cls
    for cls in (errors.BackendError, errors.EngineError, errors.GatewayError):
        assert cls("x", status_code=502).type == "api_error"  # only a 503 changes the type


async def test_upstream_429_passes_retry_after(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="status", status=429, retry_after="7")
    response = await post(fake_upstream)
    assert_envelope(response, 429, "upstream_rate_limited")
    assert response.headers["retry-after"] == "7"


async def test_unreachable_upstream(fake_upstream: FakeUpstream) -> None:
    fake_upstream.stop()
    assert_envelope(await post(fake_upstream), 502, "upstream_unreachable")


async def test_upstream_timeout_is_504(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="slow", ttft_s=2)
    app = build_app(single_model(fake_upstream, timeout_s=0.2, router={"num_retries": 0}))
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    error = assert_envelope(response, 504, "upstream_timeout")
    assert "timeout_s" in error["message"]


async def test_a_504_says_which_wait_ran_out_and_counts_the_wait_for_a_slot(fake_upstream: FakeUpstream) -> None:
    fake_upstream.behave(mode="slow", ttft_s=2)
    access = RecordingAccess(master_key=MASTER, slot_wait_s=0.3)
    routing = single_model(fake_upstream, timeout_s=0.2, max_in_flight=1, router={"num_retries": 0})
    async with asgi_client(build_app(routing, access=access)) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    message = assert_envelope(response, 504, "upstream_timeout")["message"]
    assert "timeout_s of 0.2 s, counted from when the gateway sent it the request" in message, message
    assert re.search(r"waited \d+\.\d s for a free slot of this deployment \(max_in_flight\)", message), message


@pytest.mark.parametrize("variant", [v for v in MALFORMED_VARIANTS if not v.startswith(("missing_", "tool_calls_"))])
async def test_malformed_bodies_are_502_saying_what(fake_upstream: FakeUpstream, variant: str) -> None:
    fake_upstream.behave(mode="malformed", variant=variant)
    error = assert_envelope(await post(fake_upstream), 502, "upstream_malformed_response")
    expected = {
        "not_json": "not JSON",
        "no_choices": "no `choices`",
        "empty_choices": "`choices` is empty",
        "choices_not_list": "not a list",
        "choice_not_object": "`choices[0]` is a str",
        "no_message": "has no `message`",
        "wrong_types": "`choices[0].message.content` is a int",
        "array_body": "JSON list",
        "tool_call_types": "`choices[0].message.tool_calls[0].id` is a int",
    }[variant]
    assert expected in error["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("variant", ["wrong_types", "tool_call_types", "choice_not_object"])
async def test_malformed_bodies_are_502_through_every_translation(
    fake_upstream: FakeUpstream, path: str, variant: str
) -> None:
    """The chat answer a translation reads is checked first: a wrong type is the upstream's 502, never our 500."""
    fake_upstream.behave(mode="malformed", variant=variant)
    body = {**CHAT, "input": "hi", "max_tokens": 8}
    async with asgi_client(build_app(single_model(fake_upstream, router={"num_retries": 0}))) as client:
        response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == 502, response.text
    code = response.json()["error"].get("code") or response.json()["error"]["type"]
    assert "malformed" in response.text and code in ("upstream_malformed_response", "api_error"), response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": "abc", "completion_tokens": 3},
        {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": "x"}},
    ],
)
async def test_garbage_usage_figures_are_read_as_zero_not_a_crash(
    fake_upstream: FakeUpstream, path: str, usage: dict[str, Any]
) -> None:
    fake_upstream.behave(usage=usage)
    body = {**CHAT, "input": "hi", "max_tokens": 8}
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text


async def test_repairable_bodies_are_repaired(fake_upstream: FakeUpstream) -> None:
    app = build_app(single_model(fake_upstream))
    async with asgi_client(app) as client:
        fake_upstream.behave(mode="malformed", variant="missing_index")
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).json()["choices"][0]["index"] == 0
        fake_upstream.behave(mode="malformed", variant="missing_finish_reason")
        choice = (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        fake_upstream.behave(mode="malformed", variant="tool_calls_no_content")
        message = (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).json()["choices"][0]["message"]
        assert message["content"] is None and message["tool_calls"][0]["id"] == "call_1"
        fake_upstream.behave(mode="malformed", variant="tool_calls_arguments_object")
        message = (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).json()["choices"][0]["message"]
        assert orjson.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


class ExplodingBackend:
    name = "gpt-test#0"

    def supports(self, endpoint: str) -> bool:
        return True

    async def send(self, endpoint: str, body: Any, *, request_id: str, headers: Any = None, tenancy: Any = None) -> Any:
        raise RuntimeError("secret internal detail /etc/passwd")

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


async def test_local_engine_still_loading_is_503_with_retry_after(fake_upstream: FakeUpstream) -> None:
    from backends.local import LocalBackend

    release = threading.Event()

    def load() -> Any:  # a model load that has not finished yet
        release.wait(60)
        raise RuntimeError("the test ended before the load finished")

    local = LocalBackend("gpt-test#0", load, load_wait_s=0)
    app = build_app(single_model(fake_upstream), backends={"gpt-test#0": local})
    try:
        async with asgi_client(app) as client:
            response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert not app.state.router.is_cooling(app.state.router.deployments[0])  # never a cooldown
    finally:
        release.set()
        await local.aclose()
    error = assert_envelope(response, 503, "engine_loading")
    assert response.headers["retry-after"] == "5" and "still loading" in error["message"]


async def test_unknown_exception_is_500_without_traceback(fake_upstream: FakeUpstream) -> None:
    app = build_app(single_model(fake_upstream), backends={"gpt-test#0": ExplodingBackend()})
    async with asgi_client(app) as client:
        response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    error = assert_envelope(response, 500, "internal_error")
    assert "secret internal detail" not in response.text
    assert response.headers["x-request-id"] in error["message"]


async def test_anthropic_family_gets_anthropic_envelope(fake_upstream: FakeUpstream) -> None:
    async def messages(request: Request) -> Response:
        from auth.base import extract_credential

        extract_credential(request.headers)
        return Response("unreachable")

    app = create_app(
        make_settings(),
        routing=parse_routing(single_model(fake_upstream), source="t"),
        extra_routes=[Route("/v1/messages/_probe", messages, methods=["POST"])],
    )
    async with asgi_client(app) as client:
        response = await client.post("/v1/messages/_probe", json={})
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "missing_api_key"
    assert response.headers["request-id"] == response.headers["x-request-id"]


async def test_unknown_route_and_method_use_the_envelope(fake_upstream: FakeUpstream) -> None:
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        missing = await client.post("/v1/nothing/here", json={}, headers=AUTH)
        assert_envelope(missing, 404, "not_found")
        wrong = await client.get("/v1/chat/completions", headers=AUTH)
        assert_envelope(wrong, 405, "method_not_allowed")


async def test_an_unknown_upstream_model_is_the_requests_failure_not_the_deployments(
    fake_upstream: FakeUpstream,
) -> None:
    """A wildcard route forwards any name: a typo answered 404 by the upstream must not be retried, fall back, or
    count toward the deployment's cooldown — or one request would take every model of the route out."""
    routing = {
        "models": [
            {"id": "oa/*", "deployments": [deployment(fake_upstream)]},
            {"id": "spare", "deployments": [deployment(fake_upstream)]},
        ],
        "fallbacks": {"oa/*": ["spare"]},
        "router": {"num_retries": 2, "max_fails": 1, "retry_backoff_s": 0.001, "max_backoff_s": 0.01},
    }
    async with asgi_client(build_app(routing)) as client:
        for _ in range(3):
            fake_upstream.queue(Behavior(mode="status", status=404, variant="model_not_found"))
            response = await client.post("/v1/chat/completions", json={**CHAT, "model": "oa/nosuch"}, headers=AUTH)
            assert_envelope(response, 404, "model_not_found", param="model")
        assert [r.body["model"] for r in fake_upstream.requests] == ["nosuch"] * 3  # one attempt each, no fallback
        response = await client.post("/v1/chat/completions", json={**CHAT, "model": "oa/gpt-x"}, headers=AUTH)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
async def test_an_overlong_model_name_is_refused_on_every_route(fake_upstream: FakeUpstream, path: str) -> None:
    """A wildcard route forwards any name and usage is kept per name: a 300 KB name must not reach Redis."""
    app = build_app({"models": [{"id": "oa/*", "deployments": [deployment(fake_upstream)]}]})
    body = {**CHAT, "model": "oa/" + "x" * 253, "prompt": "hi", "input": "hi", "max_tokens": 8}
    async with asgi_client(app) as client:
        assert (await client.post(path, json=body, headers=AUTH)).status_code == 200  # 256 characters: served
        response = await client.post(path, json={**body, "model": "oa/" + "x" * 300_000}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text
    assert len(fake_upstream.requests) == 1


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"previous_response_id": "r"}, "previous_response_id"),
    ],
)
async def test_stored_state_is_refused_on_a_translated_responses_model(
    fake_upstream: FakeUpstream, extra: dict[str, Any], param: str
) -> None:
    """A model served through the chat translation keeps no responses: a request that needs them is refused, never
    answered without its history."""
    async with asgi_client(build_app(single_model(fake_upstream))) as client:
        response = await client.post("/v1/responses", json={"model": "gpt-test", "input": "hi", **extra}, headers=AUTH)
        assert_envelope(response, 400, "unsupported_parameter", param=param)
        ok = await client.post("/v1/responses", json={"model": "gpt-test", "input": "hi", "store": False}, headers=AUTH)
    assert ok.status_code == 200 and len(fake_upstream.requests) == 1


async def test_a_failing_model_behind_a_wildcard_cools_down_alone(fake_upstream: FakeUpstream) -> None:
    """A 429 or 5xx about one model a wildcard route forwards (OpenAI limits each model apart) cools that model on
    the deployment; other models of the route keep being served. A failure to connect cools the deployment."""
    routing = {
        "models": [{"id": "oa/*", "deployments": [deployment(fake_upstream)]}],
        "router": {"num_retries": 0, "max_fails": 1, "cooldown_s": 60},
    }
    async with asgi_client(build_app(routing)) as client:

        async def ask(model: str) -> httpx.Response:
            return await client.post("/v1/chat/completions", json={**CHAT, "model": model}, headers=AUTH)

        fake_upstream.queue(Behavior(mode="status", status=429, retry_after="30"), Behavior(mode="status", status=500))
        assert (await ask("oa/busy")).status_code == 429
        assert (await ask("oa/broken")).status_code == 502
        rate_limited = await ask("oa/busy")  # out for the upstream's Retry-After: its 429, with the time left
        assert_envelope(rate_limited, 429, "upstream_rate_limited")
        assert "'oa/busy'" in rate_limited.json()["error"]["message"]  # the model asked for, never the pattern
        cooling = await ask("oa/broken")
        assert_envelope(cooling, 503, "upstream_cooling_down")
        assert "'oa/broken'" in cooling.json()["error"]["message"]
        assert (await ask("oa/other")).status_code == 200
        assert len(fake_upstream.requests) == 3  # the cooling models were not sent

        fake_upstream.stop()  # (a pooled connection may first fail as a drop: that model alone cools)
        statuses = [(await ask(f"oa/model-{i}")).status_code for i in range(3)]
        assert statuses[-1] == 503 and 503 in statuses[1:]  # unreachable: every model of the deployment cools
