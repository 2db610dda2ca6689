"""OpenAI Responses endpoint (Codex CLI, the OpenAI SDK's `responses`): `POST /v1/responses`, stateless.

Models whose deployments all serve `responses` natively get the request as is; every other model gets it
translated to chat completions, and the answer (or the stream of chunks) translated into Response objects and
Responses events. A stream always ends with `response.completed` on success, `response.failed` otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.base import Json
from gateway.errors import GatewayError, InvalidRequestError
from gateway.pipeline import open_call, serves_natively
from gateway.routes.openai import JSONBytesResponse, read_json_body, require_model
from gateway.sse import EventStreamResponse, encode_event, encode_events
from gateway.translate.common import Event
from gateway.translate.responses import (
    chat_chunks_to_response_events,
    chat_to_response,
    failure_code,
    responses_to_chat,
)
from gateway.translate.sse import with_keepalive

__all__ = ["routes"]

KEEPALIVE_INTERVAL_S = 10.0
_KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: the Responses protocol has no ping event, and clients skip these


async def create_response(request: Request) -> Response:
    body = await read_json_body(request)
    model = require_model(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequestError("`stream` must be true or false.", param="stream")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and (not isinstance(max_output_tokens, int) or max_output_tokens < 1):
        raise InvalidRequestError("`max_output_tokens` must be an integer of at least 1.", param="max_output_tokens")
    if serves_natively(request, model, "responses"):
        call = await open_call(request, endpoint="responses", body=body, model=model, stream=bool(stream))
        if not stream:
            return JSONBytesResponse(orjson.dumps(await call.json()), headers=call.headers)
        events = _named(call.chunks())
    else:
        chat = responses_to_chat(body)
        call = await open_call(request, endpoint="chat/completions", body=chat, model=model, stream=bool(stream))
        if not stream:
            response = chat_to_response(await call.json(), request=body)
            return JSONBytesResponse(orjson.dumps(response), headers=call.headers)
        events = chat_chunks_to_response_events(call.chunks(), request=body)
    encoded = with_keepalive(encode_events(events), interval_s=KEEPALIVE_INTERVAL_S, keepalive=_KEEPALIVE)
    return EventStreamResponse(encoded, headers=call.headers, error_tail=_error_tail, on_close=call.aclose)


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
