"""An OpenAI-compatible upstream (`type: openai`): chat completions, completions and embeddings (and, with
`native_responses`, the Responses API) passed through the shared `UpstreamClient` (`backends.upstream`).

The OpenAI dialect: a bearer key, and a stream of chunks ending with `data: [DONE]`; a chunk carrying `error`
(and no `choices`) raises 502 `upstream_error`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any, Self

import orjson

from backends.base import Endpoint, Json, Tenancy
from backends.config import UpstreamConfig
from backends.upstream import UpstreamClient
from backends.upstream_errors import UpstreamErrors
from gateway.errors import upstream_malformed

__all__ = ["OpenAIBackend", "OpenAIDialect"]

_NATIVE: frozenset[str] = frozenset({"chat/completions", "completions", "embeddings"})


class OpenAIDialect:
    """`Authorization: Bearer`; chunks end with `[DONE]` (no event of their own ends the stream)."""

    def headers(self, api_key: str | None) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def parse_event(self, data: bytes, errors: UpstreamErrors) -> Json:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise upstream_malformed(f"a stream chunk is not JSON ({exc.msg} at position {exc.pos})") from None
        if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
            raise errors.server_error("reported an error in the middle of the stream", errors.message_of(chunk))
        return chunk  # type: ignore[no-any-return]

    def is_keepalive(self, event: Json) -> bool:
        return False

    def ends_stream(self, event: Json) -> bool:
        return False


class OpenAIBackend:
    """One `type: openai` deployment. `name` is the deployment's stable id (never a hostname); `options` are the
    other fields of `UpstreamConfig`."""

    def __init__(self, name: str, *, base_url: str, api_key: str | None, **options: Any) -> None:
        config = UpstreamConfig(name, base_url=base_url, api_key=api_key, **options)
        self.name = name
        self._native = _NATIVE | {"responses"} if config.native_responses else _NATIVE
        self._upstream = UpstreamClient(config, OpenAIDialect())

    @classmethod
    def from_config(cls, config: UpstreamConfig) -> Self:
        return cls(**dataclasses.asdict(config))

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in self._native

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,  # (an upstream serves everyone alike)
    ) -> Json:
        return await self._upstream.send(endpoint, body, request_id=request_id, headers=_trace_context(headers))

    def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,  # (an upstream serves everyone alike)
    ) -> AsyncIterator[Json]:
        return self._upstream.stream(endpoint, body, request_id=request_id, headers=_trace_context(headers))

    async def check_health(self) -> bool:
        return await self._upstream.check_health()

    async def list_models(self, *, max_ids: int) -> list[str]:
        """The upstream's model ids (`GET /models`), for what a wildcard route lists (`gateway.wildcard_models`)."""
        return await self._upstream.list_models(max_ids=max_ids)

    async def aclose(self) -> None:
        await self._upstream.aclose()


_TRACE_HEADERS = ("traceparent", "tracestate")


def _trace_context(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """Of the headers the gateway hands over, what an OpenAI-compatible upstream gets: the W3C trace context (the
    client's own headers, e.g. `anthropic-beta`, are for Anthropic upstreams only)."""
    if not headers:
        return None
    return {name: headers[name] for name in _TRACE_HEADERS if name in headers} or None
