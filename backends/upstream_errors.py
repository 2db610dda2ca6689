"""An upstream's failures as `gateway.errors` types, translated once at the boundary (as httpx maps httpcore's).

`UpstreamErrors` holds what the messages need (the deployment's name and limits) and what they must never show
(the upstream key and the base_url's host, redacted from anything the upstream sends back). The text of an
upstream's server-side failure (a 5xx, a 529, an error body or stream event) is not relayed at all: it may name
internal hosts (`pool-7.internal:8443`), so the error carries it in `upstream_text` for the log (the pipeline logs
it with the request id) and the client reads the gateway's own message. A 4xx's text is relayed (redacted): it
tells the caller what to fix.

    HTTP 401/403                       502 upstream_auth_failed (the gateway's own upstream key, not the caller's)
    HTTP 3xx                           502 upstream_error (never followed)
    HTTP 429                           429 upstream_rate_limited (with a usable Retry-After, as whole seconds)
    HTTP 529, overloaded_error         503 upstream_overloaded (Anthropic's "overloaded"; its text withheld)
    HTTP 5xx                           502 upstream_error (its text withheld)
    other statuses                     502 upstream_error
    HTTP 404                           404 model_not_found (or the upstream's code): the request's, not the
                                           deployment's failure, so it neither retries nor cools the deployment
    HTTP 400/409/413/415/422           400 (413) with the upstream's code, else invalid_request; a code that says
                                           the gateway's upstream key is bad: 502 upstream_auth_failed
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
    NotFoundError,
    UpstreamOverloadedError,
    UpstreamRateLimitedError,
    UpstreamTimeoutError,
)

__all__ = ["UpstreamErrors"]

_KEY_PATTERN = re.compile(r"(sk|key|token|org)[-_][A-Za-z0-9_\-*.]{6,}", re.IGNORECASE)  # org-: OpenAI's org ids
# Codes (or Google's error reasons) with which some upstreams answer a bad key with 400 instead of 401.
_AUTH_CODES = frozenset({"invalid_api_key", "authentication_error", "permission_error", "API_KEY_INVALID"})
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
        code = _upstream_code(content)
        if status in (401, 403) or (status == 400 and code in _AUTH_CODES):
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
        if status == 529 or code == "overloaded_error":
            return self.server_error(f"is overloaded (HTTP {status})", detail, is_overloaded=True)
        if status >= 500:
            return self.server_error(f"failed with HTTP {status}", detail)
        if status == 404:
            return NotFoundError(
                f"The upstream answered HTTP 404 ({detail}): it does not serve the model the request named (check "
                "the model id), or the deployment's base_url is wrong.",
                code=code or "model_not_found",
                param="model",
            )
        if status in (400, 409, 413, 415, 422):
            return InvalidRequestError(
                f"The upstream rejected the request (HTTP {status}): {detail}",
                code=code or "invalid_request",
                status_code=413 if status == 413 else 400,
            )
        return BackendError(
            f"The upstream answered HTTP {status} ({detail}); check the deployment's `model` and `base_url`.",
            code="upstream_error",
        )

    def server_error(self, what: str, detail: str, *, is_overloaded: bool = False) -> BackendError:
        """The upstream's own server-side failure: the upstream `what` (the gateway's words: "failed with HTTP 503"),
        with its text (`detail`) kept for the log only, never relayed (see the module docstring)."""
        kind = UpstreamOverloadedError if is_overloaded else BackendError
        error = kind(
            f"The upstream of deployment {self.name!r} {what}. Its own error message is not passed on (it may name "
            "internal hosts); the gateway logs it. Retry later."
        )
        error.upstream_text = self.redact(detail)
        return error

    def event_error(self, error: BackendError) -> BackendError:
        """An error a stream event reported (`error` built from it, with the upstream's text in its message): a
        rate limit keeps that text (redacted), a server-side failure becomes `server_error`."""
        if error.status_code < 500:
            error.message = self.redact(error.message)
            return error
        is_overloaded = error.code == "upstream_overloaded"
        what = "is overloaded" if is_overloaded else "reported an error"
        return self.server_error(f"{what} in the middle of the stream", error.message, is_overloaded=is_overloaded)

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
    """The upstream's error code: OpenAI's `error.code`, Anthropic's `overloaded_error` type, or the `reason` of
    Google's `error.details` (its bad key is 400 INVALID_ARGUMENT with reason API_KEY_INVALID)."""
    data = _loads_or_none(content)
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    details = error.get("details")
    reasons = [d.get("reason") for d in details if isinstance(d, dict)] if isinstance(details, list) else []
    overloaded = "overloaded_error" if error.get("type") == "overloaded_error" else None
    for code in (error.get("code"), overloaded, *reasons):
        if isinstance(code, str) and code.replace("_", "").isalnum() and len(code) <= 64:
            return code
    return None
