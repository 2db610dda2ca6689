"""An OpenAI-compatible upstream over one pooled aiohttp `ClientSession` (HTTP/1.1, keep-alive, explicit limits).

Why aiohttp and not httpx: measured on the 2-core benchmark box against the same fake upstream, httpx 0.28's
pool collapses under concurrency (~2,100 req/s at c=1, ~300 req/s at c=32), httpx over an aiohttp transport
reaches ~3,600 req/s, and aiohttp alone ~11,000-14,000 req/s (see the README, Gateway > Benchmark).

Every client exception and every upstream failure status is translated to a `gateway.errors` type here, at the
boundary (the way httpx maps httpcore's exceptions). Messages never carry the upstream key or the base_url host.

Hardening against a hostile or broken upstream (docs/upstreams.md): redirects are never followed (a 3xx is 502
`upstream_error`, so neither the prompt nor the upstream key goes to another origin); a body is read only up to
`max_response_bytes` and one SSE event up to `max_event_bytes`, decompressed (502 `upstream_malformed_response`
past them); a stream that sends no event within `first_event_timeout_s`, or none for `idle_timeout_s` after one
(comments and pings do not count), is 504 `upstream_timeout`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Self
from urllib.parse import urlsplit

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from backends.base import Endpoint, Json
from backends.retry_after import parse_retry_after, retry_after_header
from backends.watchdog import StreamStalled, StreamWatchdog
from gateway.errors import (
    BackendError,
    GatewayError,
    InvalidRequestError,
    UpstreamRateLimitedError,
    UpstreamTimeoutError,
)
from gateway.normalize import malformed
from gateway.settings import Settings
from gateway.sse import SSEDecoder

__all__ = ["OpenAIBackend"]

_NATIVE: frozenset[str] = frozenset({"chat/completions", "completions", "embeddings"})
_KEY_PATTERN = re.compile(r"(sk|key|token)[-_][A-Za-z0-9_\-*.]{6,}", re.IGNORECASE)
_MAX_MESSAGE = 300
_HEALTH_TIMEOUT_S = 3.0
_MAX_ERROR_BODY = 64 * 1024  # an error answer is read only as far as its message needs


def encode_body(body: Json) -> bytes:
    """The body to send upstream. orjson reads JSON nested 1024 levels deep but writes only 254, so a body between
    the two is the caller's 400, not the gateway's 500."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise InvalidRequestError(
            "The request body is nested too deeply to forward: at most 254 levels of arrays and objects.",
            code="invalid_request",
        ) from None


class OpenAIBackend:
    """One `type: openai` deployment. `name` is the deployment's stable id (never a hostname)."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        api_key: str | None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_connections: int = 100,
        keepalive_s: float = 30.0,
        native_responses: bool = False,
        max_response_bytes: int = 64 * 1024 * 1024,
        max_event_bytes: int = 8 * 1024 * 1024,
        first_event_timeout_s: float = 600.0,
        idle_timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self._native = _NATIVE | {"responses"} if native_responses else _NATIVE
        self.timeout_s = timeout_s
        self._base_url = base_url.rstrip("/") + "/"
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._secrets = [s for s in (api_key, urlsplit(base_url).hostname) if s]
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=min(read_timeout_s, timeout_s)
        )
        # Non-streaming calls: aiohttp's own deadline over the whole exchange (headers and body), which costs less
        # per request than an asyncio.timeout() around it; both raise TimeoutError.
        self._send_timeout = aiohttp.ClientTimeout(
            total=timeout_s, connect=connect_timeout_s, sock_read=min(read_timeout_s, timeout_s)
        )
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._max_response_bytes = max_response_bytes
        self._max_event_bytes = max_event_bytes
        self._first_event_timeout_s = first_event_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, deployment: Any, settings: Settings) -> Self:
        return cls(
            deployment.name,
            base_url=deployment.base_url,
            api_key=deployment.api_key,
            timeout_s=deployment.timeout_s or settings.request_timeout_s,
            connect_timeout_s=deployment.connect_timeout_s or settings.connect_timeout_s,
            read_timeout_s=settings.read_timeout_s,
            max_connections=deployment.max_connections,
            native_responses=getattr(deployment, "native_responses", False),
            max_response_bytes=settings.max_upstream_response_bytes,
            max_event_bytes=settings.max_sse_event_bytes,
            first_event_timeout_s=settings.stream_first_token_timeout_s,
            idle_timeout_s=settings.stream_idle_timeout_s,
        )

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in self._native

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the serving event loop (aiohttp binds a session to its loop).
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=self._keepalive_s
            )
            self._session = aiohttp.ClientSession(
                self._base_url, connector=connector, headers=self._headers, timeout=self._timeout
            )
        return self._session

    async def send(self, endpoint: Endpoint, body: Json, *, request_id: str) -> Json:
        try:
            async with self._client().post(
                endpoint,
                data=encode_body(body),
                headers={"x-request-id": request_id},
                timeout=self._send_timeout,
                allow_redirects=False,
            ) as response:
                content = await self._read_body(response)
        except TimeoutError:
            raise self._timeout_error() from None
        except aiohttp.ClientError as exc:
            raise self._map_exception(exc) from None
        if response.status >= 300:
            raise self._status_error(response.status, content, response.headers)
        return self._parse_json(content, response.headers.get("content-type", ""))

    async def stream(self, endpoint: Endpoint, body: Json, *, request_id: str) -> AsyncIterator[Json]:
        headers = {"x-request-id": request_id, "accept": "text/event-stream"}
        started_at = asyncio.get_running_loop().time()
        is_first_event_sooner = self._first_event_timeout_s < self.timeout_s
        try:
            # The headers must come within the deployment's timeout and before the first event is due.
            async with asyncio.timeout(min(self.timeout_s, self._first_event_timeout_s)):
                response = await self._client().post(
                    endpoint, data=encode_body(body), headers=headers, allow_redirects=False
                )
        except TimeoutError:
            raise (self._stalled_error(is_first=True) if is_first_event_sooner else self._timeout_error()) from None
        except aiohttp.ClientError as exc:
            raise self._map_exception(exc) from None
        is_complete = False
        try:
            content_type = response.headers.get("content-type", "")
            if response.status >= 300:
                raise self._status_error(response.status, await self._read_body(response), response.headers)
            if not content_type.startswith("text/event-stream"):
                # Some servers ignore `stream: true` or answer with an HTML/JSON page and status 200.
                data = self._parse_json(await self._read_body(response), content_type)
                raise malformed(f"expected an event stream but got a JSON object with keys {sorted(data)[:5]}")
            async for chunk in self._events(response, started_at=started_at):
                yield chunk
            is_complete = True
        finally:
            if is_complete:
                response.release()
            else:
                response.close()  # drop the connection so the upstream stops generating at once

    async def _events(self, response: aiohttp.ClientResponse, *, started_at: float) -> AsyncIterator[Json]:
        """The stream's events up to `[DONE]` (or `_ends_stream`), keep-alives dropped, under the watchdog's
        first-event and idle deadlines (counted from `started_at`, loop time, when the request was sent)."""
        watchdog = StreamWatchdog(
            response.content,
            started_at=started_at,
            first_s=self._first_event_timeout_s,
            idle_s=self._idle_timeout_s,
        )
        has_finished = False
        try:
            async with aclosing(self._sse_data(response)) as events:
                async for data in events:
                    if data == b"[DONE]":
                        return
                    chunk = self._parse_chunk(data)
                    if self._is_keepalive(chunk):
                        continue  # no progress: the idle deadline keeps running
                    has_finished = has_finished or _has_finish_reason(chunk)
                    watchdog.is_paused = True  # the consumer's time with the event is not the upstream's
                    yield chunk
                    watchdog.resume()
                    if self._ends_stream(chunk):
                        return
        finally:
            watchdog.cancel()
        if not has_finished:
            raise BackendError(
                "The upstream stream ended before it finished (no finish_reason and no [DONE]); the output above "
                "is incomplete. Retry the request.",
                code="upstream_error",
            )

    async def _sse_data(self, response: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
        """Each SSE event's data, the last one flushed when the body ends without a blank line; transport errors,
        the event size cap and the watchdog's verdict become our errors here."""
        decoder = SSEDecoder(max_event_bytes=self._max_event_bytes)
        try:
            async for raw in response.content.iter_any():
                for _, data in decoder.feed(raw):
                    yield data
        except StreamStalled as stalled:
            raise self._stalled_error(is_first=stalled.is_first) from None
        except TimeoutError:
            raise self._timeout_error() from None
        except aiohttp.ClientError as exc:
            raise self._map_exception(exc, is_mid_stream=True) from None
        for _, data in decoder.flush():
            yield data

    async def check_health(self) -> bool:
        """Reachable: /models answers without a server error; a redirect counts as down (it is never followed,
        so every request would fail)."""
        try:
            async with asyncio.timeout(_HEALTH_TIMEOUT_S):
                async with self._client().get("models", allow_redirects=False) as response:
                    return response.status < 300 or 400 <= response.status < 500
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- error mapping -------------------------------------------------------------------------------------

    async def _read_body(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, decompressed, up to `max_response_bytes` (502 `upstream_malformed_response` past it); an
        error answer's body only up to `_MAX_ERROR_BODY`, truncated silently."""
        is_error = response.status >= 300
        max_bytes = _MAX_ERROR_BODY if is_error else self._max_response_bytes
        try:
            content, is_whole = await _read_capped(response, max_bytes)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self._map_exception(exc) from None
        if not is_whole and not is_error:
            raise malformed(
                f"the response body is larger than the gateway's limit of {max_bytes} bytes "
                "(UNIGATE_MAX_UPSTREAM_RESPONSE_BYTES)"
            )
        return content

    def _is_keepalive(self, chunk: Json) -> bool:
        """An event that carries nothing (dropped, and no progress for the idle deadline)."""
        return False

    def _ends_stream(self, chunk: Json) -> bool:
        """An event after which the stream is over (OpenAI streams end with `[DONE]` instead)."""
        return False

    def _parse_chunk(self, data: bytes) -> Json:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise malformed(f"a stream chunk is not JSON ({exc.msg} at position {exc.pos})") from None
        if isinstance(chunk, dict) and "error" in chunk and "choices" not in chunk:
            raise BackendError(
                f"The upstream reported an error mid-stream: {self._upstream_message(chunk)}. Retry the request.",
                code="upstream_error",
            )
        return chunk  # type: ignore[no-any-return]

    def _parse_json(self, content: bytes, content_type: str) -> Json:
        if "html" in content_type or content.lstrip()[:1] == b"<":
            raise malformed(
                "an HTML page instead of JSON (the deployment's base_url probably points at a website or proxy "
                "login page, not an OpenAI-compatible API)"
            )
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise malformed(f"the body is not JSON ({exc.msg} at position {exc.pos})") from None
        if isinstance(data, dict) and "error" in data and "choices" not in data and "data" not in data:
            raise BackendError(
                f"The upstream answered with an error: {self._upstream_message(data)}. Retry the request.",
                code="upstream_error",
            )
        if not isinstance(data, dict):
            raise malformed(f"the body is a JSON {type(data).__name__}, not an object")
        return data

    def _status_error(self, status: int, content: bytes, headers: CIMultiDictProxy[str]) -> GatewayError:
        if status in (401, 403):
            return BackendError(
                f"The upstream of deployment {self.name!r} rejected the gateway's own upstream credentials "
                f"(HTTP {status}). This is not about your API key: the gateway operator must fix the deployment's "
                "api_key in the routing file.",
                code="upstream_auth_failed",
            )
        if 300 <= status < 400:  # never followed: it could send the prompt and the upstream key elsewhere
            return BackendError(
                f"The upstream of deployment {self.name!r} answered with a redirect (HTTP {status}), which the "
                "gateway never follows; the request went nowhere else. The gateway operator must point the "
                "deployment's base_url at the API itself.",
                code="upstream_error",
            )
        detail = self._upstream_message(_loads_or_none(content))
        if status == 429:
            # Only a usable Retry-After is passed on (as whole seconds); the router bounds the cooldown.
            retry_after = parse_retry_after(headers.get("retry-after"))
            if retry_after is None:
                return UpstreamRateLimitedError(f"The upstream is rate limiting the gateway (HTTP 429: {detail}).")
            wait = retry_after_header(retry_after)
            return UpstreamRateLimitedError(
                f"The upstream is rate limiting the gateway (HTTP 429: {detail}). Retry after {wait} s.",
                headers={"retry-after": wait},
            )
        if status >= 500:
            return BackendError(
                f"The upstream failed with HTTP {status} ({detail}). Retry later.", code="upstream_error"
            )
        if status in (400, 409, 413, 415, 422):
            code = _upstream_code(content)
            return InvalidRequestError(
                f"The upstream rejected the request (HTTP {status}): {detail}",
                code=code or "invalid_request",
                status_code=413 if status == 413 else 400,
            )
        return BackendError(
            f"The upstream answered HTTP {status} ({detail}); check the deployment's `model` and `base_url`.",
            code="upstream_error",
        )

    def _map_exception(self, exc: Exception, *, is_mid_stream: bool = False) -> GatewayError:
        if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            return BackendError(
                f"Could not connect to the upstream of deployment {self.name!r}; it is down or unreachable from "
                "the gateway. Retry later.",
                code="upstream_unreachable",
            )
        if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
            return self._timeout_error()
        where = "in the middle of the stream" if is_mid_stream else "before sending a complete response"
        return BackendError(
            f"The upstream closed the connection {where}. Retry the request.",
            code="upstream_error",
        )

    def _stalled_error(self, *, is_first: bool) -> UpstreamTimeoutError:
        if is_first:
            return UpstreamTimeoutError(
                f"The upstream of deployment {self.name!r} sent no stream event within "
                f"{self._first_event_timeout_s:g} s of the request (UNIGATE_STREAM_FIRST_TOKEN_TIMEOUT_S). Retry "
                "the request."
            )
        return UpstreamTimeoutError(
            f"The upstream of deployment {self.name!r} sent no stream event for {self._idle_timeout_s:g} s in the "
            "middle of the stream (UNIGATE_STREAM_IDLE_TIMEOUT_S); the output above is incomplete. Retry the request."
        )

    def _timeout_error(self) -> UpstreamTimeoutError:
        return UpstreamTimeoutError(
            f"The upstream of deployment {self.name!r} did not answer within its timeout_s of {self.timeout_s:g} s, "
            "counted from when the gateway sent it the request. Retry, or raise the deployment's timeout_s."
        )

    def _upstream_message(self, data: Any) -> str:
        message = "no detail"
        if isinstance(data, dict):
            error = data.get("error", data)
            if isinstance(error, dict):
                message = str(error.get("message") or error.get("detail") or "no detail")
            elif isinstance(error, str):
                message = error
        return self._redact(message)

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        text = _KEY_PATTERN.sub("[redacted]", text)
        return text[:_MAX_MESSAGE]


def _has_finish_reason(chunk: Json) -> bool:
    choices = chunk.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
    return False


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> tuple[bytes, bool]:
    """`(body, is_whole)`: the decompressed body up to `max_bytes`. When there is more, the rest is not read and
    the connection is closed (aiohttp inflates as it is read, so a compressed bomb never lands in memory whole)."""
    length = response.content_length
    if length is not None and length > max_bytes and "content-encoding" not in response.headers:
        response.close()
        return b"", False
    pieces: list[bytes] = []
    num_bytes = 0
    async for piece in response.content.iter_any():
        num_bytes += len(piece)
        if num_bytes > max_bytes:
            response.close()
            return b"".join(pieces), False
        pieces.append(piece)
    return b"".join(pieces), True


def _loads_or_none(content: bytes) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return None


def _upstream_code(content: bytes) -> str | None:
    data = _loads_or_none(content)
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        code = data["error"].get("code")
        if isinstance(code, str) and code.replace("_", "").isalnum():
            return code
    return None
