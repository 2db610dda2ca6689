"""An upstream's failures as `gateway.errors` types, translated once at the boundary (as httpx maps httpcore's).

`UpstreamErrors` holds what the messages need (the deployment's name and limits) and what they must never show
(the upstream key and the base_url's host, redacted from anything the upstream sends back).

    HTTP 401/403                       502 upstream_auth_failed (the gateway's own upstream key, not the caller's)
    HTTP 3xx                           502 upstream_error (never followed)
    HTTP 429                           429 upstream_rate_limited (with a usable Retry-After, as whole seconds)
    HTTP 5xx, other statuses           502 upstream_error
    HTTP 400/409/413/415/422           400 (413) with the upstream's code, else invalid_request
    cannot connect                     502 upstream_unreachable
    deadline passed / no event in time 504 upstream_timeout
    connection closed                  502 upstream_error
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from multidict import CIMultiDictProxy

from backends.config import UpstreamConfig
from backends.retry_after import parse_retry_after, retry_after_header
from gateway.errors import (
    BackendError,
    GatewayError,
    InvalidRequestError,
    UpstreamRateLimitedError,
    UpstreamTimeoutError,
)

__all__ = ["UpstreamErrors"]

_KEY_PATTERN = re.compile(r"(sk|key|token)[-_][A-Za-z0-9_\-*.]{6,}", re.IGNORECASE)
_MAX_MESSAGE = 300


class UpstreamErrors:
    """The error for each way one deployment's upstream can fail; every upstream text in them is redacted."""

    __slots__ = ("_config", "_secrets", "name")

    def __init__(self, config: UpstreamConfig) -> None:
        self.name = config.name
        self._config = config
        self._secrets = [s for s in (config.api_key, urlsplit(config.base_url).hostname) if s]

    def status(self, status: int, content: bytes, headers: CIMultiDictProxy[str]) -> GatewayError:
        """An answer with a failure status (`content`: its body, possibly cut short)."""
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
        detail = self.message_of(_loads_or_none(content))
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

    def transport(self, exc: Exception, *, is_mid_stream: bool = False) -> GatewayError:
        """A client exception (aiohttp's, or a deadline's `TimeoutError`)."""
        if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            return BackendError(
                f"Could not connect to the upstream of deployment {self.name!r}; it is down or unreachable from "
                "the gateway. Retry later.",
                code="upstream_unreachable",
            )
        if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one too
            return self.timeout()
        where = "in the middle of the stream" if is_mid_stream else "before sending a complete response"
        return BackendError(
            f"The upstream closed the connection {where}. Retry the request.",
            code="upstream_error",
        )

    def stalled(self, *, is_first: bool) -> UpstreamTimeoutError:
        """No stream event in time: none at all since the request (`is_first`), or none for a while after one."""
        if is_first:
            return UpstreamTimeoutError(
                f"The upstream of deployment {self.name!r} sent no stream event within "
                f"{self._config.first_event_timeout_s:g} s of the request (UNIGATE_STREAM_FIRST_TOKEN_TIMEOUT_S). "
                "Retry the request."
            )
        return UpstreamTimeoutError(
            f"The upstream of deployment {self.name!r} sent no stream event for {self._config.idle_timeout_s:g} s in "
            "the middle of the stream (UNIGATE_STREAM_IDLE_TIMEOUT_S); the output above is incomplete. Retry the "
            "request."
        )

    def timeout(self) -> UpstreamTimeoutError:
        return UpstreamTimeoutError(
            f"The upstream of deployment {self.name!r} did not answer within its timeout_s of "
            f"{self._config.timeout_s:g} s, counted from when the gateway sent it the request. Retry, or raise the "
            "deployment's timeout_s."
        )

    def message_of(self, data: Any) -> str:
        """The upstream's own error message in a parsed body (`{"error": {"message": ...}}` and the like)."""
        message = "no detail"
        if isinstance(data, dict):
            error = data.get("error", data)
            if isinstance(error, dict):
                message = str(error.get("message") or error.get("detail") or "no detail")
            elif isinstance(error, str):
                message = error
        return self.redact(message)

    def redact(self, text: str) -> str:
        """`text` without the upstream key, the base_url's host or anything shaped like a key, cut short."""
        for secret in self._secrets:
            text = text.replace(secret, "[redacted]")
        text = _KEY_PATTERN.sub("[redacted]", text)
        return text[:_MAX_MESSAGE]


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
