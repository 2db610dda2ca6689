"""Anthropic Messages endpoints (Claude Code, the Anthropic SDKs): `POST /v1/messages` and `/v1/messages/count_tokens`.

A model whose deployments all speak Messages (`type: anthropic`) gets the request as is; every other model gets it
translated to chat completions and the answer translated back. Any `anthropic-version`, unknown `anthropic-beta`
flags and query strings such as `?beta=true` are accepted. Errors use Anthropic's envelope (the error middleware
renders everything under /v1/messages that way); rate-limit headers come in Anthropic's naming as well as OpenAI's.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from backends.base import CountsPromptTokens, Endpoint
from gateway.call_context import call_context
from gateway.errors import GatewayError, InvalidRequestError
from gateway.estimates import estimate_prompt_tokens
from gateway.pipeline import open_call, serves_natively
from gateway.routes.openai import JSONBytesResponse, read_json_body
from gateway.sse import EventStreamResponse, encode_event, encode_events
from gateway.translate.anthropic import (
    chat_chunks_to_events,
    chat_to_message,
    error_event,
    guard_events,
    messages_to_chat,
)
from gateway.translate.anthropic_meta import anthropic_headers, anthropic_model_list
from gateway.translate.sse import with_keepalive
from gateway.validate import check_count_tokens_request, check_messages_request

__all__ = ["anthropic_headers", "anthropic_model_list", "routes"]

PING_INTERVAL_S = 10.0  # Anthropic's own streams ping about this often; proxies cut idle connections at 30-60 s
_PING = encode_event("ping", {"type": "ping"})


async def create_message(request: Request) -> Response:
    context = await call_context(request)  # 401 for a bad key, before any work on the body
    body = await read_json_body(request)
    model = check_messages_request(body)
    stream = bool(body.get("stream"))
    is_native = serves_natively(context.router, model, "messages")
    if is_native:
        endpoint: Endpoint = "messages"
        upstream_body = body
    else:
        endpoint, upstream_body = "chat/completions", messages_to_chat(body)
    call = await open_call(context, endpoint=endpoint, body=upstream_body, model=model, stream=stream)
    if not stream:
        data = await call.json()
        if not is_native:
            data = chat_to_message(data, model=call.served_model, stop_sequences=body.get("stop_sequences"))
        # (after the answer: it may add headers, e.g. x-unigate-max-tokens-clamped)
        headers = anthropic_headers(call.headers, request_id=context.request_id)
        return JSONBytesResponse(orjson.dumps(data), headers=headers)
    headers = anthropic_headers(call.headers, request_id=context.request_id)
    if is_native:
        events = guard_events(call.chunks())
    else:
        events = chat_chunks_to_events(
            call.chunks(),
            model=call.served_model,
            input_tokens=estimate_prompt_tokens("messages", body),
            stop_sequences=body.get("stop_sequences"),
        )
    encoded = with_keepalive(encode_events(events), interval_s=PING_INTERVAL_S, keepalive=_PING)
    return EventStreamResponse(encoded, headers=headers, error_tail=_error_tail, on_close=call.aclose)


async def count_tokens(request: Request) -> Response:
    """Exact counts from an Anthropic upstream, and from the local engine (the model's chat template and tokenizer,
    as the request would be billed); elsewhere the gateway's estimate (characters / 4), marked `"estimated": true`.
    Clients use this to decide when a conversation nears the context limit."""
    context = await call_context(request)
    body = await read_json_body(request)
    model = check_count_tokens_request(body)
    headers = {"request-id": context.request_id}
    if serves_natively(context.router, model, "messages/count_tokens"):
        call = await open_call(context, endpoint="messages/count_tokens", body=body, model=model, stream=False)
        data = await call.json()
        return JSONBytesResponse(orjson.dumps(data), headers=headers)
    target = context.router.resolve(model, visible=context.principal.may_use)  # 404: models it may not see or use
    counters = [d.backend for d in target.route.deployments if isinstance(d.backend, CountsPromptTokens)]
    if counters and len(counters) == len(target.route.deployments):
        num_tokens = await counters[0].count_prompt_tokens(messages_to_chat(body))
        return JSONBytesResponse(orjson.dumps({"input_tokens": num_tokens}), headers=headers)
    num_tokens = estimate_prompt_tokens("messages", body) + _tools_chars(body.get("tools")) // 4
    return JSONBytesResponse(orjson.dumps({"input_tokens": num_tokens, "estimated": True}), headers=headers)


def _tools_chars(tools: object) -> int:
    try:
        return len(orjson.dumps(tools or []))
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (254 levels)
        raise InvalidRequestError("`tools` is nested too deeply.", code="invalid_request", param="tools") from None


def _error_tail(error: GatewayError) -> bytes:
    """How a stream ends when it fails outside the translators (e.g. the gateway shutting down)."""
    name, data = error_event(error)
    return encode_event(name, data)


def routes() -> list[Route]:
    return [
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
