"""An Anthropic-compatible upstream (`type: anthropic`): Messages natively, chat completions by translation.

It shares `OpenAIBackend`'s pooled client, timeouts and error mapping, so an Anthropic upstream fails exactly like
any other (401/403 → 502 `upstream_auth_failed`, 429 → `upstream_rate_limited` with retry-after, 5xx →
`upstream_error`, connect → `upstream_unreachable`, timeout → 504 `upstream_timeout`, garbage →
`upstream_malformed_response`); only the credential headers and the meaning of stream events differ (named events
ending with `message_stop`, no `[DONE]`; an `error` event raises). `base_url` includes the
version prefix, as for every deployment (`https://api.anthropic.com/v1`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from backends.base import Endpoint, Json
from backends.openai import OpenAIBackend
from gateway.errors import InvalidRequestError
from gateway.normalize import malformed
from gateway.translate.anthropic_upstream import (
    chat_to_messages,
    error_from_event,
    events_to_chat_chunks,
    message_to_chat,
)

__all__ = ["ANTHROPIC_VERSION", "AnthropicBackend"]

ANTHROPIC_VERSION = "2023-06-01"
_NATIVE: frozenset[str] = frozenset({"messages", "messages/count_tokens"})


class AnthropicBackend(OpenAIBackend):
    """One `type: anthropic` deployment. `supports()` is true for `messages`, `messages/count_tokens` and
    `chat/completions` (translated here, so the gateway can treat chat completions as every backend's language)."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        api_key: str | None,
        anthropic_version: str = ANTHROPIC_VERSION,
        **options: Any,
    ) -> None:
        super().__init__(name, base_url=base_url, api_key=None, **options)
        self._headers["anthropic-version"] = anthropic_version
        if api_key:
            self._headers["x-api-key"] = api_key
            self._secrets.append(api_key)

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in _NATIVE or endpoint == "chat/completions"

    async def send(self, endpoint: Endpoint, body: Json, *, request_id: str) -> Json:
        if endpoint == "chat/completions":
            message = await super().send("messages", chat_to_messages(body), request_id=request_id)
            return message_to_chat(message, model=str(body.get("model", "")))
        self._check_endpoint(endpoint)
        return await super().send(endpoint, _anthropic_body(body), request_id=request_id)

    async def stream(self, endpoint: Endpoint, body: Json, *, request_id: str) -> AsyncIterator[Json]:
        """Anthropic events (without pings) for `messages`; chat chunks, ending with a usage chunk, for
        `chat/completions`."""
        if endpoint == "chat/completions":
            request = {**chat_to_messages(body), "stream": True}
            events = super().stream("messages", request, request_id=request_id)
            async for chunk in events_to_chat_chunks(events, model=str(body.get("model", ""))):
                yield chunk
            return
        self._check_endpoint(endpoint)
        async for event in super().stream(endpoint, {**_anthropic_body(body), "stream": True}, request_id=request_id):
            yield event

    def _check_endpoint(self, endpoint: Endpoint) -> None:
        if endpoint not in _NATIVE:
            raise InvalidRequestError(
                f"Deployment {self.name!r} is an Anthropic upstream and cannot serve /v1/{endpoint}; use a model "
                "served by an OpenAI-compatible upstream or the local engine.",
                code="unsupported_endpoint",
            )

    # Anthropic's stream is read by the OpenAI backend's SSE loop (which maps transport errors, applies the size
    # and time limits, and raises when the stream ends early): pings are keep-alives (no progress for the idle
    # deadline), and `message_stop` ends the stream, as there is no `[DONE]`.
    def _is_keepalive(self, chunk: Json) -> bool:
        return bool(chunk["type"] == "ping")

    def _ends_stream(self, chunk: Json) -> bool:
        return bool(chunk["type"] == "message_stop")

    def _parse_chunk(self, data: bytes) -> Json:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise malformed(f"a stream event is not JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise malformed("a stream event has no `type`")
        if event["type"] == "error":
            error = error_from_event(event)
            error.message = self._redact(error.message)
            raise error
        return event


def _anthropic_body(body: Json) -> Json:
    """The body without OpenAI-only fields Anthropic rejects (`stream_options`, which the Messages route sets so
    the pipeline forwards events carrying `usage` untouched)."""
    return {name: value for name, value in body.items() if name != "stream_options"}
