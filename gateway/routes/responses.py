"""OpenAI Responses endpoint (Codex CLI, the OpenAI SDK's `responses`): `POST /v1/responses`, stateless.

Models whose deployments all serve `responses` natively get the request as is; every other model gets it
translated to chat completions, and the answer (or the stream of chunks) translated into Response objects and
Responses events. A stream always ends with `response.completed` on success, `response.failed` otherwise.

Stored state (`previous_response_id`, `conversation`, `store: true`) is refused with 400 unless every deployment
of the model sets `allow_stored_responses: true`: all tenants share the upstream key, so stored responses would
be readable across tenants. Without the opt-in a native request that leaves `store` unset is sent `store: false`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.base import Json
from gateway.call_context import call_context
from gateway.errors import GatewayError, InvalidRequestError
from gateway.pipeline import open_call, serves_natively
from gateway.router import Router
from gateway.routes.openai import JSONBytesResponse, read_json_body
from gateway.sse import EventStreamResponse, encode_event, encode_events
from gateway.translate.common import Event
from gateway.translate.responses import (
    chat_chunks_to_response_events,
    chat_to_response,
    failure_code,
    responses_to_chat,
)
from gateway.translate.sse import with_keepalive
from gateway.validate import check_responses_request

__all__ = ["routes"]

KEEPALIVE_INTERVAL_S = 10.0
_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: the Responses protocol has no ping event, and clients skip these


async def create_response(request: Request) -> Response:
    context = await call_context(request)  # 401 for a bad key, before any work on the body
    body = await read_json_body(request)
    model = check_responses_request(body)
    stream = bool(body.get("stream"))
    if serves_natively(context.router, model, "responses"):
        if not _allows_stored_responses(context.router, model):
            body = _without_stored_state(body)
        call = await open_call(context, endpoint="responses", body=body, model=model, stream=stream)
        data = None if stream else await call.json()
        if data is not None:
            return JSONBytesResponse(orjson.dumps(data), headers=call.headers)
        events = _named(call.chunks())
    else:
        chat = responses_to_chat(_without_stored_state(body))  # a translation keeps no state either
        with _named_as_input():
            call = await open_call(context, endpoint="chat/completions", body=chat, model=model, stream=stream)
            data = None if stream else await call.json()
        served = {**body, "model": call.served_model}  # the answer names the model that served (a fallback's id)
        if data is not None:
            response = chat_to_response(data, request=served)
            return JSONBytesResponse(orjson.dumps(response), headers=call.headers)
        events = chat_chunks_to_response_events(call.chunks(), request=served)
    encoded = with_keepalive(encode_events(events), interval_s=KEEPALIVE_INTERVAL_S, keepalive=_KEEPALIVE)
    return EventStreamResponse(encoded, headers=call.headers, error_tail=_error_tail, on_close=call.aclose)


@contextmanager
def _named_as_input() -> Iterator[None]:
    """A refusal of the translated chat request names `messages`, which this client never sent: its `input` (with
    `instructions`) is what became them."""
    try:
        yield
    except InvalidRequestError as error:
        if error.param is not None and error.param.startswith("messages"):
            error.param = "input"
        raise


_STORED_STATE = ("previous_response_id", "conversation")


def _allows_stored_responses(router: Router, model: str) -> bool:
    target = router.find(model)
    return target is not None and all(d.config.allow_stored_responses for d in target.route.deployments)


def _without_stored_state(body: Json) -> Json:
    """400 for a request that needs stored state; `store: false` made explicit (the upstream default is true)."""
    for name in _STORED_STATE:
        if body.get(name) is not None:
            raise InvalidRequestError(
                f"`{name}` is not accepted here: this deployment does not share stored responses between the "
                "gateway's tenants. Resend the whole conversation in `input` (and set `store: false`).",
                code="unsupported_parameter",
                param=name,
            )
    store = body.get("store")
    if store is None:
        return {**body, "store": False}
    if store is not False:
        raise InvalidRequestError(
            "`store` must be false here: this deployment keeps no responses for the gateway's tenants.",
            code="unsupported_parameter",
            param="store",
        )
    return body


async def _named(events: AsyncIterator[Json]) -> AsyncIterator[Event]:
    try:
        async for event in events:
            yield str(event.get("type", "")), event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _error_tail(error: GatewayError) -> bytes:
    """How a stream ends when it fails outside the translator (a native stream breaking, shutdown)."""
    data = {"type": "error", "code": failure_code(error), "message": error.message, "param": None, "sequence_number": 0}
    return encode_event("error", data)


def routes() -> list[Route]:
    return [Route("/v1/responses", create_response, methods=["POST"])]
