"""What one request went through, noted by the stages as it happens: the request log's record
(auth/request_log.py) and, when tracing is on (gateway/tracing.py), its OpenTelemetry spans.

    trace = RequestTrace.begin(scope, tracing)              # gateway/middleware/request_log.py, on arrival
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
    record = trace.finish(...)                             # gateway/middleware/request_log.py, at the end

It lives in the ASGI scope's state, so the middleware finds it whatever happened below (a limit's 429, an upstream
failure, a client gone). It holds counts, names and times only: never text of the request or the answer (neither
in the record nor in a span attribute). Without tracing, every span call is one `None` check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from auth.base import Principal, SettleUsage
from auth.request_log import AttemptRecord, EndedBy, RequestRecord
from gateway.tracing import Tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["RequestTrace", "api_family"]

_STATE_KEY = "request_trace"
_TIMEOUT_CODES = frozenset({"upstream_timeout"})
# The GenAI semantic conventions' operation names, per endpoint.
_OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings"}
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


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
    attempts: list[AttemptRecord] = field(default_factory=list)
    deployment: str | None = None
    served_model: str | None = None
    is_stream: bool = False
    ttft_s: float | None = None
    usage: SettleUsage | None = None
    num_cached_tokens: int = 0
    error_code: str = ""  # the envelope's code, also for an error after a stream started ("" : none)
    tracing: Tracing | None = None
    span: Span | None = None  # the request's root span (tracing on)
    _attempt_span: Span | None = None
    _last_attempt_span: Span | None = None  # the engine's stages hang under the attempt that ran them
    _stream_span: Span | None = None
    _settle_span: Span | None = None

    @classmethod
    def begin(cls, scope: MutableMapping[str, Any], tracing: Tracing | None = None) -> RequestTrace:
        trace = cls(time.perf_counter(), time.time_ns(), tracing=tracing)
        if tracing is not None:
            trace.span = tracing.start_request(
                scope.get("headers") or (), f"{scope['method']} {scope['path']}", trace.started_ns
            )
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
        if self.span is not None:
            self.span.set_attribute("unigate.key_id", principal.key_id or "master")
            if principal.team_id:
                self.span.set_attribute("unigate.team_id", principal.team_id)

    def requested(self, endpoint: str, model: str, body: dict[str, Any], *, stream: bool) -> None:
        self.model, self.is_stream = model, stream
        if self.span is None:
            return
        operation = _OPERATIONS.get(endpoint, "chat")
        self.span.update_name(f"{operation} {model}")
        self.span.set_attribute("gen_ai.operation.name", operation)
        self.span.set_attribute("gen_ai.request.model", model)
        for name in _MAX_TOKENS_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                self.span.set_attribute("gen_ai.request.max_tokens", value)
                break
        self.span.set_attribute("unigate.stream", stream)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A child span around a stage (authentication, admission); an error ends it with the error's code."""
        if self.tracing is None or self.span is None:
            yield
            return
        span = self.tracing.start_child(self.span, name, start_ns=time.time_ns())
        try:
            yield
        except BaseException as error:
            _set_error(span, getattr(error, "code", type(error).__name__))
            raise
        finally:
            span.end()

    def attempt_started(self, deployment: str, server_address: str | None) -> dict[str, str]:
        """Open the attempt's span; the `traceparent` headers that make the upstream's spans its children."""
        if self.tracing is None or self.span is None:
            return {}
        attributes: dict[str, Any] = {"unigate.deployment": deployment}
        if server_address:
            attributes["server.address"] = server_address
        self._attempt_span = span = self.tracing.start_child(
            self.span,
            f"unigate.attempt {deployment}",
            start_ns=time.time_ns(),
            kind=self.tracing.client_kind,
            attributes=attributes,
        )
        self._last_attempt_span = span
        return self.tracing.headers_for(span)

    def slot_waited(self, started_perf: float, ended_perf: float) -> None:
        """The attempt's wait for one of the deployment's `max_in_flight` slots."""
        if self.tracing is not None and self._attempt_span is not None:
            self.tracing.start_child(self._attempt_span, "unigate.upstream_slot", start_ns=self._ns(started_perf)).end(
                end_time=self._ns(ended_perf)
            )

    def attempted(self, deployment: str, status: int, duration_s: float, code: str = "") -> None:
        start_s = time.perf_counter() - duration_s - self.started_perf
        self.attempts.append(
            AttemptRecord(deployment, status, round(duration_s * 1000, 2), code, round(start_s * 1000, 2))
        )
        span, self._attempt_span = self._attempt_span, None
        if span is not None:
            if status:
                span.set_attribute("http.response.status_code", status)
            if code:
                _set_error(span, code)
            span.end()

    def engine_stages(self, queued_ns: int, scheduled_ns: int, first_token_ns: int, finished_ns: int) -> None:
        """The local engine's queue, prefill and decode as child spans of the attempt that ran them; the times
        (wall clock, ns since the epoch) were taken in the engine's process. A stage not reached is 0."""
        if self.tracing is None or self.span is None:
            return
        parent = self._last_attempt_span or self.span
        stages = (
            ("unigate.engine.queue", queued_ns, scheduled_ns),
            ("unigate.engine.prefill", scheduled_ns, first_token_ns),
            ("unigate.engine.decode", first_token_ns, finished_ns),
        )
        for name, start_ns, end_ns in stages:
            if start_ns and end_ns >= start_ns:
                self.tracing.start_child(parent, name, start_ns=start_ns).end(end_time=end_ns)

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
        if self.tracing is not None and self.span is not None and self.is_stream:
            self._stream_span = self.tracing.start_child(self.span, "unigate.stream", start_ns=self._ns(now))

    def settled(self, usage: SettleUsage, num_cached_tokens: int = 0) -> None:
        self.usage, self.num_cached_tokens = usage, num_cached_tokens
        stream, self._stream_span = self._stream_span, None
        if stream is not None:
            stream.end()
        if self.tracing is not None and self.span is not None:
            self._settle_span = self.tracing.start_child(self.span, "unigate.settle", start_ns=time.time_ns())

    def settle_done(self) -> None:
        span, self._settle_span = self._settle_span, None
        if span is not None:
            span.end()

    # -- the end -----------------------------------------------------------------------------------------------------

    def finish(self, *, request_id: str, route: str, status: int, client_left: bool) -> RequestRecord | None:
        """End the spans; the request log's record (None for a request whose key was never verified)."""
        code = self.error_code or ("client_disconnected" if client_left else "")
        duration_s = time.perf_counter() - self.started_perf
        for span in (self._attempt_span, self._stream_span, self._settle_span):
            if span is not None:
                span.end()
        self._attempt_span = self._stream_span = self._settle_span = None
        record = self._record(request_id, route, status, code, duration_s, client_left)
        if self.span is not None:
            self._end_root(self.span, record, status, code)
        return record

    def _record(
        self, request_id: str, route: str, status: int, code: str, duration_s: float, client_left: bool
    ) -> RequestRecord | None:
        principal = self.principal
        if principal is None:
            return None
        ended_by: EndedBy = "finished"
        if client_left:
            ended_by = "client_left"
        elif code in _TIMEOUT_CODES:
            ended_by = "timeout"
        elif code or status >= 400:
            ended_by = "error"
        usage = self.usage
        return RequestRecord(
            time_ms=self.started_ns // 1_000_000,
            request_id=request_id,
            key_id=principal.key_id,
            key_name=principal.name,
            team_id=principal.team_id,
            api=api_family(route),
            route=route,
            model=self.model,
            deployment=self.deployment,
            status=status,
            code=code,
            ended_by=ended_by,
            is_stream=self.is_stream,
            fallback=self.served_model if self.served_model not in (None, self.model) else None,
            attempts=tuple(self.attempts),
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=self.num_cached_tokens,
            is_estimated=usage.is_estimated if usage else False,
            cost_micros=usage.cost_micros if usage else 0,
            ttft_ms=None if self.ttft_s is None else round(self.ttft_s * 1000, 2),
            duration_ms=round(duration_s * 1000, 2),
        )

    def _end_root(self, span: Span, record: RequestRecord | None, status: int, code: str) -> None:
        span.set_attribute("http.response.status_code", status)
        if self.served_model:
            span.set_attribute("gen_ai.response.model", self.served_model)
        if self.deployment:
            span.set_attribute("unigate.deployment", self.deployment)
        if self.usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", self.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", self.usage.completion_tokens)
            span.set_attribute("unigate.cost_usd", str(Decimal(self.usage.cost_micros) / 1_000_000))
            span.set_attribute("unigate.usage_estimated", self.usage.is_estimated)
        if record is not None:
            span.set_attribute("unigate.request_id", record.request_id)
            span.set_attribute("unigate.ended_by", record.ended_by)
        if code or status >= 500:
            _set_error(span, code or str(status))
        span.end()


def _set_error(span: Span, error_type: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR))
