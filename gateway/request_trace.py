"""What one request went through, noted by the stages as it happens: the request log's record
(auth/request_log.py) and, when tracing is on (gateway/tracing.py), its OpenTelemetry spans.

    trace = RequestTrace.begin(scope, tracing)              # gateway/middleware/request_trace.py, on arrival
    trace.authenticated(principal)                         # gateway/call_context.py
    trace.requested(endpoint, model, body, stream=...)     # gateway/pipeline.py, before admission
    with trace.stage("unigate.admission"): ...             # gateway/ledger.py
    headers = trace.attempt_started(deployment, host)      # gateway/attempt.py: `traceparent` for the upstream
    trace.slot_waited(started, ended)                      #   its wait for a max_in_flight slot
    trace.attempted(deployment, status, duration_s, code)  #   its end
    trace.engine_stages(queued, scheduled, first, finished) #   the local engine's queue / prefill / decode
    trace.answered(deployment, model)                      # gateway/pipeline.py, the try that answered
    trace.first_token()                                    #   a stream's first chunk
    trace.settled(usage)  ...  trace.settle_done()         # gateway/ledger.py, the charge
    row = trace.finish(...)                                # gateway/middleware/request_trace.py, at the end

It lives in the ASGI scope's state, so the middleware finds it whatever happened below (a limit's 429, an upstream
failure, a client gone). It holds counts, names and times only: never text of the request or the answer (neither
in the record nor in a span attribute). A traced request's spans are kept by its `RequestSpans`
(gateway/request_spans.py); without one, every span note is one `None` check.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from auth.base import Principal, SettleUsage
from auth.request_log import AttemptRow, EndedBy, RecordRow
from gateway.request_spans import RequestSpans
from gateway.tracing import Tracing

__all__ = ["NO_STAGE", "RequestTrace", "api_family"]

_STATE_KEY = "request_trace"
_TIMEOUT_CODES = frozenset({"upstream_timeout"})


@functools.lru_cache(maxsize=256)
def _host(base_url: str) -> str | None:
    """An upstream's host (a span's `server.address`)."""
    return urlsplit(base_url).hostname


class _Stage:
    __slots__ = ("name", "spans", "start_ns")

    def __init__(self, spans: RequestSpans, name: str) -> None:
        self.spans, self.name, self.start_ns = spans, name, 0

    def __enter__(self) -> None:
        self.start_ns = time.time_ns()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        error = "" if exc is None else getattr(exc, "code", type(exc).__name__)
        self.spans.add(self.name, self.start_ns, time.time_ns(), error=error)


NO_STAGE = contextlib.nullcontext()  # a stage no span is kept for: one shared no-op


def api_family(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/responses"):
        return "responses"
    return "openai"


@dataclass(slots=True)
class RequestTrace:
    started_perf: float
    started_ns: int  # wall clock (ns since the epoch) at `started_perf`
    principal: Principal | None = None  # None until the key is verified (an unverified request is not logged)
    model: str = ""  # as requested
    attempts: list[AttemptRow] = field(default_factory=list)
    deployment: str | None = None
    served_model: str | None = None
    is_stream: bool = False
    ttft_s: float | None = None
    usage: SettleUsage | None = None
    num_cached_tokens: int = 0
    error_code: str = ""  # the envelope's code, also for an error after a stream started ("" : none)
    spans: RequestSpans | None = None  # tracing on and this request sampled

    @classmethod
    def begin(cls, scope: MutableMapping[str, Any], tracing: Tracing | None = None) -> RequestTrace:
        trace = cls(time.perf_counter(), time.time_ns())
        if tracing is not None:
            traced = tracing.start_request(scope.get("headers") or ())
            if traced is not None:
                trace.spans = RequestSpans(tracing, traced, f"{scope['method']} {scope['path']}", trace.started_ns)
        scope.setdefault("state", {})[_STATE_KEY] = trace
        return trace

    @staticmethod
    def of(request_state: MutableMapping[str, Any] | None) -> RequestTrace | None:
        trace = (request_state or {}).get(_STATE_KEY)
        return trace if isinstance(trace, RequestTrace) else None

    def _ns(self, perf: float) -> int:
        return self.started_ns + int((perf - self.started_perf) * 1e9)

    # -- the stages --------------------------------------------------------------------------------------------------

    def authenticated(self, principal: Principal) -> None:
        self.principal = principal
        if self.spans is not None:
            self.spans.authenticated(principal)

    def requested(self, endpoint: str, model: str, body: dict[str, Any], *, stream: bool) -> None:
        self.model, self.is_stream = model, stream
        if self.spans is not None:
            self.spans.requested(endpoint, model, body, stream)

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A child span around a stage (authentication, admission); an error ends it with the error's code. An
        unsampled request gets one shared no-op (a generator-based context manager cost ~1.5 µs a stage)."""
        return NO_STAGE if self.spans is None else _Stage(self.spans, name)

    def attempt_started(self, deployment: str, base_url: str | None) -> dict[str, str]:
        """Open the attempt's span (`base_url`: the upstream's, None for the local engine); the `traceparent`
        headers that make the upstream's spans its children."""
        if self.spans is None:
            return {}
        return self.spans.attempt_started(deployment, None if base_url is None else _host(base_url))

    def slot_waited(self, started_perf: float, ended_perf: float) -> None:
        """The attempt's wait for one of the deployment's `max_in_flight` slots."""
        if self.spans is not None:
            self.spans.slot_waited(self._ns(started_perf), self._ns(ended_perf))

    def attempted(self, deployment: str, status: int, duration_s: float, code: str = "") -> None:
        start_s = time.perf_counter() - duration_s - self.started_perf
        self.attempts.append((deployment, status, _ms(duration_s), code, _ms(start_s)))
        if self.spans is not None:
            self.spans.attempted(status, code)

    def engine_stages(self, queued_ns: int, scheduled_ns: int, first_token_ns: int, finished_ns: int) -> None:
        """The local engine's queue, prefill and decode as child spans of the attempt that ran them; the times
        (wall clock, ns since the epoch) were taken in the engine's process. A stage not reached is 0."""
        if self.spans is not None:
            self.spans.engine_stages(queued_ns, scheduled_ns, first_token_ns, finished_ns)

    def failed(self, code: str) -> None:
        """The request failed with this error code (the first one noted stays: a later one is its echo)."""
        if not self.error_code:
            self.error_code = code

    def answered(self, deployment: str, served_model: str) -> None:
        self.deployment, self.served_model = deployment, served_model

    def first_token(self) -> None:
        if self.ttft_s is not None:
            return
        now = time.perf_counter()
        self.ttft_s = now - self.started_perf
        if self.spans is not None and self.is_stream:
            self.spans.first_token(self._ns(now))

    def settled(self, usage: SettleUsage, num_cached_tokens: int = 0) -> None:
        self.usage, self.num_cached_tokens = usage, num_cached_tokens
        if self.spans is not None:
            self.spans.settled()

    def settle_done(self) -> None:
        if self.spans is not None:
            self.spans.settle_done()

    # -- the end -----------------------------------------------------------------------------------------------------

    def finish(self, *, request_id: str, route: str, status: int, client_left: bool) -> RecordRow | None:
        """End the spans; the request log's record, as its values in field order (None for a request whose key
        was never verified)."""
        code = self.error_code or ("client_disconnected" if client_left else "")
        ended_by: EndedBy = "finished"
        if client_left:
            ended_by = "client_left"
        elif code in _TIMEOUT_CODES:
            ended_by = "timeout"
        elif code or status >= 400:
            ended_by = "error"
        duration_s = time.perf_counter() - self.started_perf
        principal = self.principal
        row = None
        if principal is not None:
            usage = self.usage
            served = self.served_model
            row = (  # RequestRecord's fields, in order (auth/request_log.py)
                self.started_ns // 1_000_000,
                request_id,
                principal.key_id,
                principal.name,
                principal.team_id,
                api_family(route),
                route,
                self.model,
                self.deployment,
                status,
                code,
                ended_by,
                self.is_stream,
                served if served is not None and served != self.model else None,  # the fallback that answered
                self.attempts,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
                self.num_cached_tokens,
                usage.is_estimated if usage else False,
                usage.cost_micros if usage else 0,
                None if self.ttft_s is None else _ms(self.ttft_s),
                _ms(duration_s),
            )
        if self.spans is not None:
            self.spans.finish(
                status=status,
                code=code,
                deployment=self.deployment,
                served_model=self.served_model,
                usage=self.usage,
                request_id=request_id,
                ended_by=None if row is None else ended_by,
            )
        return row


def _ms(seconds: float) -> float:
    """Milliseconds to two decimals (`round(x)` to an int and a division: a third of `round(x, 2)`)."""
    return round(seconds * 100_000) / 100
