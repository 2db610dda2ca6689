"""OpenAI-compatible endpoints, all built on `gateway.pipeline.open_call`.

The caller's key is verified first (`call_context`): an unknown key costs no body work. The body is then parsed once
with orjson; only what routing and accounting need (the presence and shape of `messages` / `prompt` / `input`) and
the fields every family shares (`model`, sampling, tools) are checked, by the route's one `gateway.validate` check;
everything else is forwarded as is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from auth.base import AccessControl, Principal, extract_credential
from backends.base import Endpoint, Json, ReportsEngineStats
from gateway.call_context import CallContext, call_context
from gateway.errors import InvalidRequestError
from gateway.pipeline import Call, open_call
from gateway.router import ModelRoute, Router
from gateway.settings import Settings
from gateway.sse import DONE, EventStreamResponse, encode_data
from gateway.translate.anthropic_meta import anthropic_model_list
from gateway.validate import check_chat_request, check_completions_request, check_embeddings_request
from gateway.wildcard_models import WildcardModels

__all__ = ["JSONBytesResponse", "authenticate", "openai_routes", "read_json_body"]


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

    Verify the key before (`call_context` or `authenticate`: 401): a misconfigured client learns about its key
    before it learns about its payload, and a caller without a valid key costs no parsing, translation or
    estimation work."""
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


class _SettleAfterResponse(JSONBytesResponse):
    """Sends the body, then settles the call (`open_call(settle_after_response=True)`), whatever happened while
    sending."""

    def __init__(self, content: bytes, *, headers: dict[str, str], call: Call) -> None:
        super().__init__(content, headers=headers)
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.call.aclose()


async def _respond(context: CallContext, endpoint: Endpoint, body: Json, model: str, stream: bool) -> Response:
    call = await open_call(
        context, endpoint=endpoint, body=body, model=model, stream=stream, settle_after_response=True
    )
    if stream:
        return EventStreamResponse(_encode(call), headers=call.headers, on_close=call.aclose)
    data = await call.json()
    if call.settles_late:
        return _SettleAfterResponse(orjson.dumps(data), headers=call.headers, call=call)
    return JSONBytesResponse(orjson.dumps(data), headers=call.headers)


async def _encode(call: Call) -> AsyncIterator[bytes]:
    async with aclosing(call.chunks()) as chunks:
        async for chunk in chunks:
            yield encode_data(chunk)
    yield DONE


async def chat_completions(request: Request) -> Response:
    context = await call_context(request)  # 401 for a bad key, before any work on the body
    body = await read_json_body(request)
    model = check_chat_request(body)
    return await _respond(context, "chat/completions", body, model, bool(body.get("stream")))


async def completions(request: Request) -> Response:
    context = await call_context(request)
    body = await read_json_body(request)
    model = check_completions_request(body)
    return await _respond(context, "completions", body, model, bool(body.get("stream")))


async def embeddings(request: Request) -> Response:
    context = await call_context(request)
    body = await read_json_body(request)
    model = check_embeddings_request(body)
    return await _respond(context, "embeddings", body, model, False)


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
