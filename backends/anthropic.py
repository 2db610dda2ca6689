"""An Anthropic-compatible upstream (`type: anthropic`): Messages natively, chat completions by translation.

It uses the same `UpstreamClient` as every upstream (`backends.upstream`: pool, timeouts, size caps, error mapping),
so an Anthropic upstream fails exactly like any other (401/403 → 502 `upstream_auth_failed`, 429 →
`upstream_rate_limited` with retry-after, 5xx → `upstream_error`, connect → `upstream_unreachable`, timeout → 504
`upstream_timeout`, garbage → `upstream_malformed_response`); only its dialect differs: the credential headers and
the meaning of stream events (named events ending with `message_stop`, no `[DONE]`; pings are keep-alives; an
`error` event raises). `base_url` includes the version prefix, as for every deployment
(`https://api.anthropic.com/v1`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any, Self

import orjson

from backends.anthropic_translate import chat_to_messages, error_from_event, events_to_chat_chunks, message_to_chat
from backends.base import Endpoint, Json, Tenancy
from backends.config import UpstreamConfig
from backends.upstream import UpstreamClient
from backends.upstream_errors import UpstreamErrors
from gateway.errors import InvalidRequestError, upstream_malformed

__all__ = ["ANTHROPIC_VERSION", "AnthropicBackend", "AnthropicDialect"]

ANTHROPIC_VERSION = "2023-06-01"
_NATIVE: frozenset[str] = frozenset({"messages", "messages/count_tokens"})


class AnthropicDialect:
    """`x-api-key` and `anthropic-version`; named events, `ping` as keep-alive, `message_stop` last."""

    def __init__(self, anthropic_version: str = ANTHROPIC_VERSION) -> None:
        self.anthropic_version = anthropic_version

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": self.anthropic_version}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def parse_event(self, data: bytes, errors: UpstreamErrors) -> Json:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise upstream_malformed(f"a stream event is not JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise upstream_malformed("a stream event has no `type`")
        if event["type"] == "error":
            raise errors.event_error(error_from_event(event))
        return event

    def is_keepalive(self, event: Json) -> bool:
        return bool(event["type"] == "ping")

    def ends_stream(self, event: Json) -> bool:
        return bool(event["type"] == "message_stop")


class AnthropicBackend:
    """One `type: anthropic` deployment. `supports()` is true for `messages`, `messages/count_tokens` and
    `chat/completions` (translated here, so the gateway can treat chat completions as every backend's language).
    `options` are the other fields of `UpstreamConfig`."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        api_key: str | None,
        anthropic_version: str = ANTHROPIC_VERSION,
        **options: Any,
    ) -> None:
        config = UpstreamConfig(name, base_url=base_url, api_key=api_key, **options)
        self.name = name
        self._upstream = UpstreamClient(config, AnthropicDialect(anthropic_version))

    @classmethod
    def from_config(cls, config: UpstreamConfig) -> Self:
        return cls(**dataclasses.asdict(config))

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in _NATIVE or endpoint == "chat/completions"

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,  # (an upstream serves everyone alike)
    ) -> Json:
        """A Messages body (and the client's `anthropic-beta`) goes as it came; a chat body is translated."""
        if endpoint == "chat/completions":
            message = await self._upstream.send("messages", chat_to_messages(body), request_id=request_id)
            return message_to_chat(message, model=str(body.get("model", "")))
        self._check_endpoint(endpoint)
        return await self._upstream.send(endpoint, body, request_id=request_id, headers=headers)

    async def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,  # (an upstream serves everyone alike)
    ) -> AsyncIterator[Json]:
        """Anthropic events (without pings) for `messages`; chat chunks, ending with a usage chunk, for
        `chat/completions`. A request it cannot send fails on the first `anext()`, as every backend's stream."""
        if endpoint == "chat/completions":
            request = {**chat_to_messages(body), "stream": True}
            events = self._upstream.stream("messages", request, request_id=request_id)
            chunks = events_to_chat_chunks(events, model=str(body.get("model", "")))
        else:
            self._check_endpoint(endpoint)
            chunks = self._upstream.stream(endpoint, {**body, "stream": True}, request_id=request_id, headers=headers)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def check_health(self) -> bool:
        return await self._upstream.check_health()

    async def aclose(self) -> None:
        await self._upstream.aclose()

    def _check_endpoint(self, endpoint: Endpoint) -> None:
        if endpoint not in _NATIVE:
            raise InvalidRequestError(
                f"Deployment {self.name!r} is an Anthropic upstream and cannot serve /v1/{endpoint}; use a model "
                "served by an OpenAI-compatible upstream or the local engine.",
                code="unsupported_endpoint",
            )
