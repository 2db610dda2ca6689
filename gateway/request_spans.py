"""A traced request's spans (gateway/tracing.py), noted as its trace (gateway/request_trace.py) is told what
happened. Only a request the sampler kept has one of these; the trace checks for it once per note.

    root                         "chat <model>": GenAI attributes, unigate.key_id / deployment / cost, error.type
    ├── unigate.authenticate
    ├── unigate.admission
    ├── unigate.attempt <deployment>   (CLIENT; one per try, the upstream called as its child)
    │   ├── unigate.upstream_slot      (its wait for a `max_in_flight` slot)
    │   └── unigate.engine.queue / .prefill / .decode   (the local engine's stages, timed in the engine)
    ├── unigate.stream                 (first chunk → settle)
    └── unigate.settle

On the request's path a span is only its times and ids: one tuple (`otlp_encoding.SpanRow`) appended when it ends,
no object per span and no attribute map (the export thread encodes the rows; making span objects cost the gateway
~75 µs a request, encoding included). Attributes hold counts, names and times only, never text of the request or
the answer.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from auth.base import Principal, SettleUsage
from gateway.otlp_encoding import SpanRow
from gateway.tracing import Trace, Tracing, new_span_id

__all__ = ["RequestSpans"]

# The GenAI semantic conventions' operation names, per endpoint.
_OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings"}
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
_INTERNAL, _SERVER, _CLIENT = 1, 2, 3
_NO_ATTRIBUTES: tuple[tuple[str, object], ...] = ()


class RequestSpans:
    __slots__ = (
        "_attempt",
        "_last_attempt_id",
        "_settle_start",
        "_stream_start",
        "attributes",
        "name",
        "start_ns",
        "trace",
        "tracing",
    )

    def __init__(self, tracing: Tracing, trace: Trace, name: str, start_ns: int) -> None:
        self.tracing, self.trace, self.name, self.start_ns = tracing, trace, name, start_ns
        self.attributes: list[tuple[str, object]] = []  # the root's, as the stages learn them
        # The open attempt: (span id, deployment, server address, start ns).
        self._attempt: tuple[int, str, str | None, int] | None = None
        self._last_attempt_id = 0  # the engine's stages hang under the attempt that ran them
        self._stream_start = 0
        self._settle_start = 0

    def add(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        parent_id: int = 0,
        kind: int = _INTERNAL,
        attributes: Any = _NO_ATTRIBUTES,
        error: str = "",
    ) -> None:
        """A finished child span (of the root unless `parent_id`)."""
        parent = parent_id or self.trace.root_id
        self.trace.rows.append((name, new_span_id(), parent, kind, start_ns, end_ns, attributes, error, False))

    def authenticated(self, principal: Principal) -> None:
        self.attributes.append(("unigate.key_id", principal.key_id or "master"))
        if principal.team_id:
            self.attributes.append(("unigate.team_id", principal.team_id))

    def requested(self, endpoint: str, model: str, body: dict[str, Any], stream: bool) -> None:
        operation = _OPERATIONS.get(endpoint, "chat")
        self.name = f"{operation} {model}"
        self.attributes += (("gen_ai.operation.name", operation), ("gen_ai.request.model", model))
        for name in _MAX_TOKENS_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                self.attributes.append(("gen_ai.request.max_tokens", value))
                break
        self.attributes.append(("unigate.stream", stream))

    def attempt_started(self, deployment: str, server_address: str | None) -> dict[str, str]:
        span_id = new_span_id()
        self._attempt = (span_id, deployment, server_address, time.time_ns())
        self._last_attempt_id = span_id
        return self.tracing.headers_for(self.trace, span_id)

    def slot_waited(self, start_ns: int, end_ns: int) -> None:
        if self._attempt is not None:
            self.add("unigate.upstream_slot", start_ns, end_ns, parent_id=self._attempt[0])

    def attempted(self, status: int, code: str, end_ns: int = 0) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            return
        span_id, deployment, server_address, start_ns = attempt
        attributes: list[tuple[str, object]] = [("unigate.deployment", deployment)]
        if server_address:
            attributes.append(("server.address", server_address))
        if status:
            attributes.append(("http.response.status_code", status))
        self.trace.rows.append(
            (
                f"unigate.attempt {deployment}",
                span_id,
                self.trace.root_id,
                _CLIENT,
                start_ns,
                end_ns or time.time_ns(),
                attributes,
                code,
                False,
            )
        )

    def engine_stages(self, queued_ns: int, scheduled_ns: int, first_token_ns: int, finished_ns: int) -> None:
        parent = self._last_attempt_id
        stages = (
            ("unigate.engine.queue", queued_ns, scheduled_ns),
            ("unigate.engine.prefill", scheduled_ns, first_token_ns),
            ("unigate.engine.decode", first_token_ns, finished_ns),
        )
        for name, start_ns, end_ns in stages:
            if start_ns and end_ns >= start_ns:
                self.add(name, start_ns, end_ns, parent_id=parent)

    def first_token(self, at_ns: int) -> None:
        self._stream_start = at_ns

    def settled(self) -> None:
        now = time.time_ns()
        if self._stream_start:
            self.add("unigate.stream", self._stream_start, now)
            self._stream_start = 0
        self._settle_start = now

    def settle_done(self) -> None:
        if self._settle_start:
            self.add("unigate.settle", self._settle_start, time.time_ns())
            self._settle_start = 0

    def finish(
        self,
        *,
        status: int,
        code: str,
        deployment: str | None,
        served_model: str | None,
        usage: SettleUsage | None,
        request_id: str,
        ended_by: str | None,
    ) -> None:
        """End what is still open, then the root, and queue the request's spans for export."""
        end_ns = time.time_ns()
        if self._attempt is not None:  # what is still open ends with the request
            self.attempted(0, "", end_ns)
        if self._stream_start:
            self.add("unigate.stream", self._stream_start, end_ns)
            self._stream_start = 0
        self.settle_done()
        attributes = self.attributes
        attributes.append(("http.response.status_code", status))
        if served_model:
            attributes.append(("gen_ai.response.model", served_model))
        if deployment:
            attributes.append(("unigate.deployment", deployment))
        if usage is not None:
            attributes += (
                ("gen_ai.usage.input_tokens", usage.prompt_tokens),
                ("gen_ai.usage.output_tokens", usage.completion_tokens),
                ("unigate.cost_usd", str(Decimal(usage.cost_micros) / 1_000_000)),
                ("unigate.usage_estimated", usage.is_estimated),
            )
        if ended_by is not None:
            attributes += (("unigate.request_id", request_id), ("unigate.ended_by", ended_by))
        trace = self.trace
        error = code or (str(status) if status >= 500 else "")
        row: SpanRow = (
            self.name,
            trace.root_id,
            trace.parent_id,
            _SERVER,
            self.start_ns,
            end_ns,
            attributes,
            error,
            trace.parent_id != 0,
        )
        trace.rows.append(row)
        self.tracing.export(trace)
