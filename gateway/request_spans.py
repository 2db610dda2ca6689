"""A traced request's spans (gateway/tracing.py), opened and closed as its trace (gateway/request_trace.py) is told
what happened. Only a request the sampler kept has one of these; the trace checks for it once per note.

    root                         "chat <model>": GenAI attributes, unigate.key_id / deployment / cost, error.type
    ├── unigate.authenticate
    ├── unigate.admission
    ├── unigate.attempt <deployment>   (CLIENT; one per try, the upstream called as its child)
    │   ├── unigate.upstream_slot      (its wait for a `max_in_flight` slot)
    │   └── unigate.engine.queue / .prefill / .decode   (the local engine's stages, timed in the engine)
    ├── unigate.stream                 (first chunk → settle)
    └── unigate.settle

Attributes hold counts, names and times only, never text of the request or the answer.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any

from auth.base import Principal, SettleUsage
from gateway.tracing import Span, Tracing

__all__ = ["RequestSpans"]

# The GenAI semantic conventions' operation names, per endpoint.
_OPERATIONS = {"chat/completions": "chat", "completions": "text_completion", "embeddings": "embeddings"}
_MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


class RequestSpans:
    __slots__ = ("_attempt", "_last_attempt", "_settle", "_stream", "root", "tracing")

    def __init__(self, tracing: Tracing, root: Span) -> None:
        self.tracing, self.root = tracing, root
        self._attempt: Span | None = None
        self._last_attempt: Span | None = None  # the engine's stages hang under the attempt that ran them
        self._stream: Span | None = None
        self._settle: Span | None = None

    def child(self, name: str, start_ns: int, parent: Span | None = None) -> Span:
        return self.tracing.start_child(parent or self.root, name, start_ns=start_ns)

    def authenticated(self, principal: Principal) -> None:
        self.root.set_attribute("unigate.key_id", principal.key_id or "master")
        if principal.team_id:
            self.root.set_attribute("unigate.team_id", principal.team_id)

    def requested(self, endpoint: str, model: str, body: dict[str, Any], stream: bool) -> None:
        operation = _OPERATIONS.get(endpoint, "chat")
        root = self.root
        root.update_name(f"{operation} {model}")
        root.set_attribute("gen_ai.operation.name", operation)
        root.set_attribute("gen_ai.request.model", model)
        for name in _MAX_TOKENS_FIELDS:
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                root.set_attribute("gen_ai.request.max_tokens", value)
                break
        root.set_attribute("unigate.stream", stream)

    def attempt_started(self, deployment: str, server_address: str | None) -> dict[str, str]:
        attributes: dict[str, Any] = {"unigate.deployment": deployment}
        if server_address:
            attributes["server.address"] = server_address
        self._attempt = self._last_attempt = span = self.tracing.start_child(
            self.root,
            f"unigate.attempt {deployment}",
            start_ns=time.time_ns(),
            kind=self.tracing.client_kind,
            attributes=attributes,
        )
        return self.tracing.headers_for(span)

    def slot_waited(self, start_ns: int, end_ns: int) -> None:
        if self._attempt is not None:
            self.child("unigate.upstream_slot", start_ns, self._attempt).end(end_time=end_ns)

    def attempted(self, status: int, code: str) -> None:
        span, self._attempt = self._attempt, None
        if span is not None:
            if status:
                span.set_attribute("http.response.status_code", status)
            if code:
                span.set_error(code)
            span.end()

    def engine_stages(self, queued_ns: int, scheduled_ns: int, first_token_ns: int, finished_ns: int) -> None:
        parent = self._last_attempt or self.root
        stages = (
            ("unigate.engine.queue", queued_ns, scheduled_ns),
            ("unigate.engine.prefill", scheduled_ns, first_token_ns),
            ("unigate.engine.decode", first_token_ns, finished_ns),
        )
        for name, start_ns, end_ns in stages:
            if start_ns and end_ns >= start_ns:
                self.child(name, start_ns, parent).end(end_time=end_ns)

    def first_token(self, at_ns: int) -> None:
        self._stream = self.child("unigate.stream", at_ns)

    def settled(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.end()
        self._settle = self.child("unigate.settle", time.time_ns())

    def settle_done(self) -> None:
        span, self._settle = self._settle, None
        if span is not None:
            span.end()

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
        """End what is still open, then the root (which sends the request's spans)."""
        for span in (self._attempt, self._stream, self._settle):
            if span is not None:
                span.end()
        self._attempt = self._stream = self._settle = None
        root = self.root
        root.set_attribute("http.response.status_code", status)
        if served_model:
            root.set_attribute("gen_ai.response.model", served_model)
        if deployment:
            root.set_attribute("unigate.deployment", deployment)
        if usage is not None:
            root.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            root.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            root.set_attribute("unigate.cost_usd", str(Decimal(usage.cost_micros) / 1_000_000))
            root.set_attribute("unigate.usage_estimated", usage.is_estimated)
        if ended_by is not None:
            root.set_attribute("unigate.request_id", request_id)
            root.set_attribute("unigate.ended_by", ended_by)
        if code or status >= 500:
            root.set_error(code or str(status))
        root.end()
