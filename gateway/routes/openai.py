"""OpenAI-compatible endpoints, all built on `gateway.pipeline.open_call`.

The caller's key is verified first: an unknown key costs no body work. The body is then parsed once with orjson;
only what routing and accounting need (the presence and shape of `messages` / `prompt` / `input`) and the fields
every family shares (`model`, sampling, tools: `gateway.validate`) are checked; everything else is forwarded as is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from auth.base import AccessControl, Principal, extract_credential
from backends.base import Endpoint, Json, ReportsEngineStats
from gateway.disconnect import watch_disconnect
from gateway.errors import InvalidRequestError
from gateway.pipeline import Call, open_call
from gateway.router import ModelRoute, Router
from gateway.settings import Settings
from gateway.sse import DONE, EventStreamResponse, encode_data
from gateway.translate.anthropic_meta import anthropic_model_list
from gateway.validate import check_chat, check_completions, require_model
from gateway.wildcard_models import WildcardModels

__all__ = ["JSONBytesResponse", "authenticate", "forwarding", "openai_routes", "read_json_body", "require_model"]


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else orjson.dumps(content)


async def authenticate(request: Request) -> Principal:
    """The caller, from its key header: 401 for a missing, malformed, unknown, revoked or expired key."""
    access: AccessControl = request.app.state.access
    return await access.authenticate(extract_credential(request.headers))


async def read_json_body(request: Request) -> Json:
    """The body as a JSON object; 400 `invalid_json` with the parse position otherwise.

    The key is verified first (`authenticate`: 401), before the body is read: a misconfigured client learns about
    its key before it learns about its payload, and a caller without a valid key costs no parsing, translation or
    estimation work. The admission in `open_call` verifies the key again, from the in-process cache."""
    await authenticate(request)
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} "
            f"(character {exc.pos}). Send a JSON object with Content-Type: application/json.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, not a JSON {type(body).__name__}.", code="invalid_json"
        )
    return body


@contextmanager
def forwarding(request: Request) -> Iterator[None]:
    """Around the upstream waits of a route (`open_call`, `Call.json`): a client that goes away before the
    response starts cancels them (see gateway/disconnect.py)."""
    with watch_disconnect(request.receive):
        yield


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, code="invalid_request", param=param)


def _check_messages(body: Json) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else "not a non-empty list"
        raise _invalid(f'`messages` is {what}. Send a list like [{{"role": "user", "content": "Hi"}}].', "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _invalid(f"`messages[{index}]` must be an object with a string `role`.", f"messages[{index}].role")
        if message["role"] not in _ROLES:
            roles = ", ".join(f"'{role}'" for role in _ROLES)
            raise _invalid(f"`messages[{index}].role` must be one of {roles}.", f"messages[{index}].role")
        _check_tool_calls(message.get("tool_calls"), f"messages[{index}].tool_calls")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
            param = f"messages[{index}].content"
            raise _invalid(f"`{param}` must be a string or a list of content part objects.", param)
        for position, part in enumerate(content):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                param = f"messages[{index}].content[{position}].text"
                raise _invalid(f"`{param}` must be a string.", param)


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _check_tool_calls(tool_calls: Any, param: str) -> None:
    """An assistant message's `tool_calls`: objects whose `function` has a string `name` and `arguments`."""
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise _invalid(f"`{param}` must be a list of tool call objects.", param)
    for position, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid(
                f"`{param}[{position}]` must be an object with a `function` holding a string `name`.",
                f"{param}[{position}]",
            )
        if not isinstance(function.get("arguments", ""), str):
            where = f"{param}[{position}].function.arguments"
            raise _invalid(f"`{where}` must be a string (the arguments' JSON text).", where)


def _check_present(body: Json, name: str, example: str) -> None:
    value = body.get(name)
    if not (isinstance(value, str) or (isinstance(value, list) and value)):
        what = "missing" if value is None else "not a string or a non-empty list"
        raise _invalid(f'`{name}` is {what}. Send e.g. "{name}": {example}.', name)


class _SettleAfterResponse(JSONBytesResponse):
    """Sends the body, then settles the call (`Call.settle_after_response`), whatever happened while sending."""

    def __init__(self, content: bytes, *, headers: dict[str, str], call: Call) -> None:
        super().__init__(content, headers=headers)
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.call.aclose()


async def _respond(request: Request, endpoint: Endpoint, body: Json, stream: bool) -> Response:
    with forwarding(request):
        call = await open_call(request, endpoint=endpoint, body=body, model=require_model(body), stream=stream)
    is_late = call.settle_after_response()
    if stream:
        return EventStreamResponse(_encode(call), headers=call.headers, on_close=call.aclose)
    with forwarding(request):
        data = await call.json()
    if is_late:
        return _SettleAfterResponse(orjson.dumps(data), headers=call.headers, call=call)
    return JSONBytesResponse(orjson.dumps(data), headers=call.headers)


async def _encode(call: Call) -> AsyncIterator[bytes]:
    async with aclosing(call.chunks()) as chunks:
        async for chunk in chunks:
            yield encode_data(chunk)
    yield DONE


async def chat_completions(request: Request) -> Response:
    body = await read_json_body(request)
    require_model(body)
    check_chat(body)
    _check_messages(body)
    return await _respond(request, "chat/completions", body, bool(body.get("stream")))


async def completions(request: Request) -> Response:
    body = await read_json_body(request)
    require_model(body)
    check_completions(body)
    _check_present(body, "prompt", '"Once upon a time"')
    return await _respond(request, "completions", body, bool(body.get("stream")))


async def embeddings(request: Request) -> Response:
    body = await read_json_body(request)
    require_model(body)
    _check_present(body, "input", '"text to embed"')
    return await _respond(request, "embeddings", body, False)


def _model_object(route: ModelRoute, created: int) -> Json:
    model: Json = {
        "id": route.id,
        "object": "model",
        "created": created,
        "owned_by": "unigate",
        "aliases": route.config.aliases,
    }
    for deployment in route.deployments:  # a local engine reports what benchmarks record (dtype, context length)
        if isinstance(deployment.backend, ReportsEngineStats):
            info = deployment.backend.stats()
            if info.get("loaded"):
                model.update(dtype=info.get("dtype"), max_model_len=info.get("max_model_len"), engine="unigate")
            break
    return model


def _wildcard_models(request: Request) -> WildcardModels:
    """The app's cache of what wildcard routes serve (made on first use: it lives as long as the app)."""
    state = request.app.state
    catalog: WildcardModels | None = getattr(state, "wildcard_models", None)
    if catalog is None:
        settings: Settings = state.settings
        catalog = state.wildcard_models = WildcardModels(timeout_s=settings.health_probe_timeout_s)
    return catalog


async def list_models(request: Request) -> Response:
    """The models the caller may use: model ids, then what each wildcard route's upstreams list under its prefix
    (`gateway.wildcard_models`: cached, and left out while an upstream does not answer)."""
    router: Router = request.app.state.router
    principal = await authenticate(request)
    created = int(request.app.state.started_at)
    visible = [route for route in router.routes if not route.config.is_wildcard and principal.may_use(route.id)]
    wildcard_ids = [i for i in await _wildcard_models(request).public_ids(router) if principal.may_use(i)]
    if "anthropic-version" in request.headers:  # Anthropic SDKs / Claude Code model pickers
        ids = [route.id for route in visible] + wildcard_ids
        return JSONBytesResponse(anthropic_model_list(ids, created=created))
    data = [_model_object(route, created) for route in visible]
    data += [
        {"id": i, "object": "model", "created": created, "owned_by": "unigate", "aliases": []} for i in wildcard_ids
    ]
    return JSONBytesResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    router: Router = request.app.state.router
    principal = await authenticate(request)
    model_id: str = request.path_params["model_id"]
    target = router.find(model_id)
    if target is None or not principal.may_use(target.model_id):
        raise router.not_found(model_id, visible=principal.may_use)
    return JSONBytesResponse({**_model_object(target.route, int(request.app.state.started_at)), "id": target.model_id})


def openai_routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    ]
