"""The HTTP client every upstream backend shares: one pooled aiohttp `ClientSession` (HTTP/1.1, keep-alive,
explicit limits), the size and time guards, SSE reading and error mapping. What differs between API families (the
credential headers, the meaning of stream events) is a small `Dialect` object.

Why aiohttp and not httpx: measured on the 2-core benchmark box against the same fake upstream, httpx 0.28's
pool collapses under concurrency (~2,100 req/s at c=1, ~300 req/s at c=32), httpx over an aiohttp transport
reaches ~3,600 req/s, and aiohttp alone ~11,000-14,000 req/s (see the README, Gateway > Benchmark).

Every client exception and every upstream failure status is translated to a `gateway.errors` type here, at the
boundary (`backends.upstream_errors`). Messages never carry the upstream key or the base_url host.

Hardening against a hostile or broken upstream (docs/upstreams.md): redirects are never followed (a 3xx is 502
`upstream_error`, so neither the prompt nor the upstream key goes to another origin); a body is read only up to
`max_response_bytes` and one SSE event up to `max_event_bytes`, decompressed (502 `upstream_malformed_response`
past them); a stream that sends no event within `first_event_timeout_s`, or none for `idle_timeout_s` after one
(comments and pings do not count), is 504 `upstream_timeout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import Protocol

import aiohttp
import orjson

from backends.base import Json
from backends.config import UpstreamConfig
from backends.sse import SSEDecoder
from backends.upstream_errors import UpstreamErrors
from backends.watchdog import StreamStalled, StreamWatchdog
from gateway.errors import BackendError, InvalidRequestError, upstream_malformed

__all__ = ["Dialect", "UpstreamClient", "encode_body"]

_HEALTH_TIMEOUT_S = 3.0
_MAX_ERROR_BODY = 64 * 1024  # an error answer is read only as far as its message needs
_MAX_MODEL_LIST_BYTES = 8 * 1024 * 1024  # a provider's whole catalogue with descriptions fits (~1-2 MB today)
_MAX_MODEL_ID_CHARS = 256


class Dialect(Protocol):
    """How one API family speaks over the shared client."""

    def headers(self, api_key: str | None) -> dict[str, str]:
        """The headers every request carries besides `content-type` (the upstream credentials)."""
        ...

    def parse_event(self, data: bytes, errors: UpstreamErrors) -> Json:
        """One stream event's parsed data; raises the gateway error for an error event or unusable data."""
        ...

    def is_keepalive(self, event: Json) -> bool:
        """An event that carries nothing: dropped, and no progress for the idle deadline."""
        ...

    def ends_stream(self, event: Json) -> bool:
        """An event after which the stream is over (besides a `[DONE]` data line)."""
        ...


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


class UpstreamClient:
    """Calls to one deployment's upstream. `path` is relative to the config's `base_url` (an `Endpoint`)."""

    def __init__(self, config: UpstreamConfig, dialect: Dialect) -> None:
        self.config = config
        self.errors = UpstreamErrors(config)
        self._dialect = dialect
        self._base_url = config.base_url.rstrip("/") + "/"
        self._headers = {"content-type": "application/json", **dialect.headers(config.api_key)}
        read_s = min(config.read_timeout_s, config.timeout_s)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s, sock_read=read_s)
        # Non-streaming calls: aiohttp's own deadline over the whole exchange (headers and body), which costs less
        # per request than an asyncio.timeout() around it; both raise TimeoutError.
        self._send_timeout = aiohttp.ClientTimeout(
            total=config.timeout_s, connect=config.connect_timeout_s, sock_read=read_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the serving event loop (aiohttp binds a session to its loop).
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self.config.max_connections, limit_per_host=0, keepalive_timeout=self.config.keepalive_s
            )
            self._session = aiohttp.ClientSession(
                self._base_url, connector=connector, headers=self._headers, timeout=self._timeout
            )
        return self._session

    async def send(self, path: str, body: Json, *, request_id: str, headers: Mapping[str, str] | None = None) -> Json:
        """One non-streaming call: the parsed JSON object of a successful answer (`headers`: the client's, to pass
        on; they never replace the deployment's credentials)."""
        try:
            async with self._client().post(
                path,
                data=encode_body(body),
                headers={**(headers or {}), "x-request-id": request_id},
                timeout=self._send_timeout,
                allow_redirects=False,
            ) as response:
                content = await self._read_body(response)
        except TimeoutError:
            raise self.errors.timeout() from None
        except aiohttp.ClientError as exc:
            raise self.errors.transport(exc) from None
        if response.status >= 300:
            raise self.errors.status(response.status, content, response.headers)
        return self._parse_json(content, response.headers.get("content-type", ""))

    async def stream(
        self, path: str, body: Json, *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> AsyncGenerator[Json, None]:
        """A streaming call: each event's parsed data, keep-alives dropped. Closing it early drops the connection,
        so the upstream stops generating at once."""
        headers = {**(headers or {}), "x-request-id": request_id, "accept": "text/event-stream"}
        started_at = asyncio.get_running_loop().time()
        config = self.config
        is_first_event_sooner = config.first_event_timeout_s < config.timeout_s
        try:
            # The headers must come within the deployment's timeout and before the first event is due.
            async with asyncio.timeout(min(config.timeout_s, config.first_event_timeout_s)):
                response = await self._client().post(
                    path, data=encode_body(body), headers=headers, allow_redirects=False
                )
        except TimeoutError:
            raise (self.errors.stalled(is_first=True) if is_first_event_sooner else self.errors.timeout()) from None
        except aiohttp.ClientError as exc:
            raise self.errors.transport(exc) from None
        is_complete = False
        try:
            content_type = response.headers.get("content-type", "")
            if response.status >= 300:
                raise self.errors.status(response.status, await self._read_body(response), response.headers)
            if not content_type.startswith("text/event-stream"):
                # Some servers ignore `stream: true` or answer with an HTML/JSON page and status 200.
                data = self._parse_json(await self._read_body(response), content_type)
                raise upstream_malformed(f"expected an event stream but got a JSON object with keys {sorted(data)[:5]}")
            async for event in self._events(response, started_at=started_at):
                yield event
            is_complete = True
        finally:
            if is_complete:
                response.release()
            else:
                response.close()  # drop the connection so the upstream stops generating at once

    async def check_health(self) -> bool:
        """Reachable: /models answers without a server error; a redirect counts as down (it is never followed,
        so every request would fail)."""
        try:
            async with asyncio.timeout(_HEALTH_TIMEOUT_S):
                async with self._client().get("models", allow_redirects=False) as response:
                    return response.status < 300 or 400 <= response.status < 500
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def list_models(self, *, max_ids: int) -> list[str]:
        """The model ids of the upstream's `GET /models` (`{"data": [{"id": ...}, ...]}`), in its order, at most
        `max_ids` of them; the body is read up to `_MAX_MODEL_LIST_BYTES`. Failures are the gateway's errors, as for
        a request (a redirect is not followed); the caller bounds the time."""
        try:
            async with self._client().get("models", allow_redirects=False, timeout=self._send_timeout) as response:
                if response.status >= 300:
                    raise self.errors.status(response.status, await self._read_body(response), response.headers)
                content, is_whole = await _read_capped(response, _MAX_MODEL_LIST_BYTES)
                content_type = response.headers.get("content-type", "")
        except TimeoutError:
            raise self.errors.timeout() from None
        except aiohttp.ClientError as exc:
            raise self.errors.transport(exc) from None
        if not is_whole:
            raise upstream_malformed(f"the model list is larger than {_MAX_MODEL_LIST_BYTES} bytes")
        entries = self._parse_json(content, content_type).get("data")
        if not isinstance(entries, list):
            raise upstream_malformed("the model list has no `data` list")
        ids = (entry.get("id") for entry in entries if isinstance(entry, dict))
        valid = [i for i in ids if isinstance(i, str) and 0 < len(i) <= _MAX_MODEL_ID_CHARS and i.isprintable()]
        return list(dict.fromkeys(valid))[:max_ids]

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _events(self, response: aiohttp.ClientResponse, *, started_at: float) -> AsyncIterator[Json]:
        """The stream's events up to `[DONE]` (or the dialect's last event), keep-alives dropped, under the
        watchdog's first-event and idle deadlines (counted from `started_at`, loop time, when the request was sent)."""
        dialect, errors = self._dialect, self.errors
        watchdog = StreamWatchdog(
            response.content,
            started_at=started_at,
            first_s=self.config.first_event_timeout_s,
            idle_s=self.config.idle_timeout_s,
        )
        has_finished = False
        try:
            async with aclosing(self._sse_data(response)) as events:
                async for data in events:
                    if data == b"[DONE]":
                        return
                    event = dialect.parse_event(data, errors)
                    if dialect.is_keepalive(event):
                        continue  # no progress: the idle deadline keeps running
                    has_finished = has_finished or _has_finish_reason(event)
                    watchdog.is_paused = True  # the consumer's time with the event is not the upstream's
                    yield event
                    watchdog.resume()
                    if dialect.ends_stream(event):
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
        decoder = SSEDecoder(max_event_bytes=self.config.max_event_bytes)
        try:
            async for raw in response.content.iter_any():
                for _, data in decoder.feed(raw):
                    yield data
        except StreamStalled as stalled:
            raise self.errors.stalled(is_first=stalled.is_first) from None
        except TimeoutError:
            raise self.errors.timeout() from None
        except aiohttp.ClientError as exc:
            raise self.errors.transport(exc, is_mid_stream=True) from None
        for _, data in decoder.flush():
            yield data

    async def _read_body(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, decompressed, up to `max_response_bytes` (502 `upstream_malformed_response` past it); an
        error answer's body only up to `_MAX_ERROR_BODY`, truncated silently."""
        is_error = response.status >= 300
        max_bytes = _MAX_ERROR_BODY if is_error else self.config.max_response_bytes
        try:
            content, is_whole = await _read_capped(response, max_bytes)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise self.errors.transport(exc) from None
        if not is_whole and not is_error:
            raise upstream_malformed(
                f"the response body is larger than the gateway's limit of {max_bytes} bytes "
                "(UNIGATE_MAX_UPSTREAM_RESPONSE_BYTES)"
            )
        return content

    def _parse_json(self, content: bytes, content_type: str) -> Json:
        if "html" in content_type or content.lstrip()[:1] == b"<":
            raise upstream_malformed(
                "an HTML page instead of JSON (the deployment's base_url probably points at a website or proxy "
                "login page, not an OpenAI-compatible API)"
            )
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise upstream_malformed(f"the body is not JSON ({exc.msg} at position {exc.pos})") from None
        if isinstance(data, dict) and "error" in data and "choices" not in data and "data" not in data:
            raise self.errors.server_error("answered with an error body", self.errors.message_of(data))
        if not isinstance(data, dict):
            raise upstream_malformed(f"the body is a JSON {type(data).__name__}, not an object")
        return data


def _has_finish_reason(event: Json) -> bool:
    """An OpenAI-family chunk that finishes a choice (other families end with their dialect's last event)."""
    choices = event.get("choices")
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
