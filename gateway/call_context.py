"""What the pipeline needs of one HTTP request and of the app, read once by the route: `CallContext`.

    context = await call_context(request)   # 401 for a bad key, before any work on the body
    call = await open_call(context, endpoint=..., body=..., model=..., stream=...)

Past this point nothing reads `Request` or `app.state`: the stages (`gateway.ledger`, `gateway.attempt`,
`gateway.stream_accounting`) get what they use from the context.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import Receive

from auth.base import AccessControl, Principal, UpstreamLimiter, extract_credential
from backends.base import FORWARDED_HEADERS
from gateway.metrics import GatewayMetrics
from gateway.request_trace import RequestTrace
from gateway.router import Router
from gateway.settings import Settings

__all__ = ["CallContext", "call_context"]

_MAX_FORWARDED_HEADER_CHARS = 1024


@dataclass(frozen=True, slots=True)
class CallContext:
    """One request's caller and the app's parts the pipeline uses."""

    settings: Settings
    access: AccessControl
    limiter: UpstreamLimiter  # the deployments' max_in_flight slots
    router: Router
    metrics: GatewayMetrics
    credential: str
    principal: Principal  # verified by `call_context`; admission verifies the key again, from the cache
    request_id: str
    forwarded_headers: dict[str, str] | None  # the client's headers backends may pass on
    started_at: float  # when the request arrived (the metrics middleware's clock): time to first token counts from it
    receive: Receive  # the ASGI channel the disconnect watch reads (gateway/disconnect.py)
    request_state: dict[str, Any]  # the ASGI scope's state, which the request metrics and the access log read
    session_id: str | None = None  # the client's `x-session-id` (routing: prefix_affinity keys requests by it)
    trace: RequestTrace | None = None  # what the stages note for the request log and the spans (None: neither is on)

    def label_model(self, model_id: str) -> None:
        """Name the resolved model in the request's state: the request metrics and the access log label it."""
        self.request_state["model"] = model_id


async def call_context(request: Request) -> CallContext:
    """The caller, verified (401 for a missing, malformed, unknown, revoked or expired key), with the app's parts:
    called first by every route that serves a model, so a caller without a valid key costs no body work."""
    state = request.app.state
    access: AccessControl = state.access
    credential = extract_credential(request.headers)
    request_state = request.scope.setdefault("state", {})
    trace = RequestTrace.of(request_state)
    if trace is None:
        principal = await access.authenticate(credential)
    else:
        with trace.stage("unigate.authenticate"):
            principal = await access.authenticate(credential)
        trace.authenticated(principal)  # its record says whose request it was (gateway/request_trace.py)
    return CallContext(
        settings=state.settings,
        access=access,
        limiter=state.upstream_limiter,
        router=state.router,
        metrics=state.metrics,
        credential=credential,
        principal=principal,
        request_id=_request_id(request),
        forwarded_headers=_forwarded_headers(request) or None,
        started_at=request_state.get("started_at") or time.perf_counter(),
        receive=request.receive,
        request_state=request_state,
        session_id=request.headers.get("x-session-id") or None,
        trace=trace,
    )


def _forwarded_headers(request: Request) -> dict[str, str]:
    """The client's `FORWARDED_HEADERS` that are short printable ASCII (a beta-flag list), for the backend."""
    forwarded = {}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value and len(value) <= _MAX_FORWARDED_HEADER_CHARS and value.isascii() and value.isprintable():
            forwarded[name] = value
    return forwarded


def _request_id(request: Request) -> str:
    state = request.scope.get("state") or {}
    request_id = state.get("request_id")
    return request_id if isinstance(request_id, str) else uuid.uuid4().hex
