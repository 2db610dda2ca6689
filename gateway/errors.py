"""The gateway's one error tree, rendered once per API family.

    GatewayError                      500 api_error / internal_error (also auth.scripts.ScriptError: a limit script bug)
    ├── InvalidRequestError           400 invalid_request_error (invalid_json, invalid_request, context_length_exceeded,
    │   │                                                     unsupported_parameter, invalid_messages)
    │   └── BodyTooLargeError         413 body_too_large   (431 headers_too_large is answered by the HTTP protocol)
    ├── AuthError                     401 authentication_error (missing_api_key, invalid_auth_header, metrics_forbidden)
    ├── PermissionDeniedError         403 permission_error (model_not_allowed, admin_only, metrics_forbidden)
    ├── NotFoundError                 404 not_found_error (model_not_found, not_found, key_not_found)
    ├── LimitError                    429 rate_limit_error (rate_limit_exceeded, tokens_limit_exceeded, ...)
    │   └── BudgetExceededError       429 insufficient_quota (budget_exceeded)
    ├── UnavailableError              503 (limits_unavailable, upstream_at_capacity, server_shutting_down)
    │   ├── EngineLoadingError        503 engine_loading (the local model is still loading; with Retry-After)
    │   └── OverloadedError           503 overloaded (shed by SLO-aware admission; with Retry-After)
    ├── BackendError                  502 api_error (upstream_error, upstream_unreachable, upstream_malformed_response,
    │   │                                            upstream_auth_failed)
    │   ├── UpstreamTimeoutError      504 upstream_timeout
    │   ├── UpstreamRateLimitedError  429 upstream_rate_limited
    │   └── UpstreamOverloadedError   503 upstream_overloaded (Anthropic's 529 / overloaded_error)
    ├── EngineError                   500 engine_error
    └── ClientDisconnectedError       499 client_disconnected (the client went away; nobody reads the response)

Every class carries its HTTP status, OpenAI `type` and default `code`; raise with a message that tells the
user what to do. Every 503 has the type `service_unavailable`, whichever class carries it (a 503 passed as
`status_code` takes it too: docs/gateway.md, errors). Messages must never contain upstream keys, hostnames from
config or tracebacks. Errors raised from more than one package have a constructor here (`upstream_malformed`).
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "AuthError",
    "BackendError",
    "BodyTooLargeError",
    "BudgetExceededError",
    "ClientDisconnectedError",
    "EngineError",
    "EngineLoadingError",
    "GatewayError",
    "InvalidRequestError",
    "LimitError",
    "NotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "UnavailableError",
    "UpstreamOverloadedError",
    "UpstreamRateLimitedError",
    "UpstreamTimeoutError",
    "anthropic_error_type",
    "render_anthropic",
    "render_openai",
    "upstream_malformed",
]


_UNAVAILABLE_TYPE = "service_unavailable"  # the type of every 503


class GatewayError(Exception):
    status_code: int = 500
    type: str = "api_error"
    code: str = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
            if status_code == 503:
                self.type = _UNAVAILABLE_TYPE
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(GatewayError):
    status_code = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BodyTooLargeError(InvalidRequestError):
    status_code = 413
    code = "body_too_large"


class AuthError(GatewayError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDeniedError(GatewayError):
    status_code = 403
    type = "permission_error"
    code = "permission_denied"


class NotFoundError(GatewayError):
    status_code = 404
    type = "not_found_error"
    code = "not_found"


class LimitError(GatewayError):
    status_code = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BudgetExceededError(LimitError):
    type = "insufficient_quota"
    code = "budget_exceeded"


class UnavailableError(GatewayError):
    status_code = 503
    type = _UNAVAILABLE_TYPE
    code = "service_unavailable"


class BackendError(GatewayError):
    status_code = 502
    type = "api_error"
    code = "upstream_error"
    # An upstream's own text about a server-side failure (redacted), for the gateway's log only: it may name
    # internal hosts, so it is never part of `message` (backends.upstream_errors; the pipeline logs it).
    upstream_text: str | None = None


def upstream_malformed(what: str) -> BackendError:
    """502 `upstream_malformed_response`: the upstream answered something the gateway cannot forward (`what` says
    what was wrong with it)."""
    return BackendError(
        f"The upstream returned a malformed response: {what}. The gateway did not forward it; retry, and if it "
        "persists the upstream (or the deployment's base_url) does not speak the API of its deployment type.",
        code="upstream_malformed_response",
    )


class UpstreamTimeoutError(BackendError):
    status_code = 504
    code = "upstream_timeout"


class UpstreamRateLimitedError(BackendError):
    status_code = 429
    type = "rate_limit_error"
    code = "upstream_rate_limited"


class UpstreamOverloadedError(BackendError):
    """The upstream says it is overloaded (Anthropic's 529 or `overloaded_error`): worth a retry elsewhere, and it
    counts toward the deployment's cooldown like any upstream failure."""

    status_code = 503
    type = _UNAVAILABLE_TYPE
    code = "upstream_overloaded"


class EngineError(GatewayError):
    status_code = 500
    type = "api_error"
    code = "engine_error"


class ClientDisconnectedError(GatewayError):
    """The client closed the connection before the response started (while sending its body, or while the gateway
    waited for an upstream, whose call is then cancelled). 499 is nginx's "client closed request": nothing is sent,
    but logs and metrics count it apart from failures."""

    status_code = 499
    type = "client_disconnected"
    code = "client_disconnected"


class EngineLoadingError(UnavailableError):
    """The local model is still loading (a wait of `engine.load_wait_s` ran out). Never a cooldown: the first
    request after the load finishes is served."""

    code = "engine_loading"


class OverloadedError(UnavailableError):
    """A model with an `slo` could not start the request in time: every deployment it may use is at the concurrency
    that meets the SLO and the request's wait in their queue ran out (or the queue was full). Never a cooldown: the
    deployments are healthy, only busy (gateway/slo_admission.py)."""

    code = "overloaded"


def render_openai(error: GatewayError) -> bytes:
    """The OpenAI envelope: {"error": {"message", "type", "param", "code"}}."""
    return orjson.dumps(error.to_dict())


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(error: GatewayError) -> str:
    return _ANTHROPIC_TYPES.get(error.status_code, "api_error")


def render_anthropic(error: GatewayError) -> bytes:
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}; our `code` (and `param`, when one
    field is at fault) ride along."""
    detail: dict[str, Any] = {"type": anthropic_error_type(error), "message": error.message, "code": error.code}
    if error.param is not None:
        detail["param"] = error.param
    return orjson.dumps({"type": "error", "error": detail})
