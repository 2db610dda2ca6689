"""One request's way to a deployment and back, in named stages, for every route family.

    context = await call_context(request)         # the route: the caller verified, the app's parts (call_context)
    call = await open_call(context, endpoint="chat/completions", body=body, model=model, stream=stream)
    data = await call.json()                      # non-streaming
    async with aclosing(call.chunks()) as chunks: # streaming (the upstream is already open and answered)
        async for chunk in chunks: ...

The stages, top to bottom: the ledger admits the caller and reserves the request (gateway/ledger.py); the router
runs one attempt per deployment tried, retrying and falling back around them (gateway/attempt.py,
gateway/router.py); a stream's chunks pass its accounting (gateway/stream_accounting.py); the ledger settles. The
local engine says when the request reached each stage in it (with its answer, or from its stream once closed): the
trace gets them as spans under the attempt that answered (`RequestTrace.engine_stages`).

Failures before the first byte (404, limits, every retry and fallback failing) raise from `open_call` / `json()`,
so the route can still answer with a proper status; while they wait on an upstream, a client that goes away cancels
the wait (gateway/disconnect.py). Usage is settled and slots released exactly once, in every outcome, by `json()` or
by `chunks()`'s `finally` (also when the client disconnects); call `aclose()` if you drop a streaming call without
iterating it.

`open_call(..., settle_after_response=True)` lets the client have the response before the settle's Redis round
trip is back, when the admission allows it (`Admission.settles_late`: the master key, or a key whose concurrency
limit had a slot to spare; a key's next request on this instance queues behind the settle on the same Redis
connection anyway). `call.settles_late` says whether it does: the settle is still queued before the last byte is
handed over, and the route then MUST run `aclose()` once the response is sent, which waits for it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from backends.base import ENGINE_STAGES_KEY, Endpoint, Json
from gateway.attempt import Attempt, OpenStream
from gateway.call_context import CallContext
from gateway.disconnect import unless_disconnected, watch_disconnect
from gateway.errors import GatewayError
from gateway.ledger import Ledger, Usage
from gateway.normalize import UPSTREAM_MODEL_HEADER, name_model, normalize_chunk, upstream_model_header
from gateway.output_limits import CLAMP_HEADER, clamp_header_value
from gateway.request_trace import RequestTrace
from gateway.router import Deployment, Router, Target
from gateway.routing_config import PricingConfig
from gateway.stream_accounting import StreamAccount

__all__ = ["Call", "open_call", "serves_natively"]


async def open_call(
    context: CallContext,
    *,
    endpoint: Endpoint,
    body: Json,
    model: str,
    stream: bool,
    settle_after_response: bool = False,
) -> Call:
    """Resolve `model` (404 naming close matches the caller may use), admit and reserve (403 / 429 / 503), and
    (streaming) open the upstream stream."""
    if (trace := context.trace) is not None:
        trace.requested(endpoint, model, body, stream=stream)
    target = context.router.find(model)
    if target is None:
        raise context.router.not_found(model, visible=context.principal.may_use)
    ledger = await Ledger.admit(context, target, endpoint=endpoint, body=body)
    context.label_model(target.model_id)
    settles_late = settle_after_response and ledger.admission.settles_late
    call = Call(context, ledger, target, endpoint=endpoint, body=body, settles_late=settles_late)
    if stream:
        try:
            with watch_disconnect(context.receive):
                await call.open_stream()
        except BaseException:
            await call.aclose()
            raise
    return call


class Call:
    """One admitted request on its way to a deployment; see the module docstring."""

    def __init__(
        self,
        context: CallContext,
        ledger: Ledger,
        target: Target,
        *,
        endpoint: Endpoint,
        body: Json,
        settles_late: bool = False,
    ) -> None:
        self.target = target
        self.headers: dict[str, str] = dict(ledger.admission.headers)
        self.settles_late = settles_late  # see the module docstring
        self._context = context
        self._ledger = ledger
        self._endpoint = endpoint
        self._body = body
        self._served_by: Deployment | None = None  # the deployment that answered (for its price)
        self._served_target = target  # the model that answered: the requested one, or a fallback (for its price)
        self._answer_usage: Usage | None = None  # a non-streaming answer's
        self._stream: OpenStream | None = None  # until released
        self._account: StreamAccount | None = None

    @property
    def model(self) -> str:
        return self.target.model_id

    @property
    def served_model(self) -> str:
        """The public id of the model that answered: the requested model's id, or a fallback's (known once `json()`
        returned or the stream opened); what every answer names as its `model`."""
        return self._served_target.model_id

    async def json(self) -> Json:
        """The non-streaming response, validated/repaired, after retries and fallbacks."""
        try:
            with watch_disconnect(self._context.receive):
                attempts = self._context.router.execute(
                    self.target,
                    self._send,
                    may_use=self._ledger.may_use,
                    body=self._body,
                    session_id=self._context.session_id,
                )
                attempt, data = await attempts
        except BaseException:
            await self.aclose()
            raise
        self._note_answer(attempt, data)
        stages = data.pop(ENGINE_STAGES_KEY, None)  # the local engine's report: for the trace, never the client
        if stages is not None and (trace := self._context.trace) is not None:
            _trace_engine_stages(trace, stages)
        self._answer_usage = Usage.of_answer(data)
        await self._finish()
        return data

    async def open_stream(self) -> None:
        # Waiting for the first chunk may take minutes: stop (and release everything) if the client goes away.
        attempts = self._context.router.execute(
            self.target,
            self._open_stream,
            may_use=self._ledger.may_use,
            body=self._body,
            session_id=self._context.session_id,
        )
        stream = await unless_disconnected(attempts)
        self._note_answer(stream.attempt, stream.first or {})
        self._account = StreamAccount(
            self._endpoint, self._body, served_model=self.served_model, metered=stream.usage_so_far
        )

    async def chunks(self) -> AsyncGenerator[Json, None]:
        """The streamed chunks, validated/repaired; the usage chunk is stripped unless the client asked."""
        stream, account = self._stream, self._account
        if stream is None or account is None:
            raise RuntimeError("chunks() needs a call opened with stream=True")
        try:
            first, stream.first = stream.first, None
            if first is not None:
                if (trace := self._context.trace) is not None:
                    trace.first_token()
                out = account.accept(first)
                self._context.metrics.ttft.labels(self.model).observe(time.perf_counter() - self._context.started_at)
                if out is not None:
                    yield out
            async for chunk in stream.chunks:
                out = account.accept(normalize_chunk(self._endpoint, chunk))
                if out is not None:
                    yield out
        except GatewayError as error:
            stream.attempt.record_stream_failure(error)
            if (trace := self._context.trace) is not None:
                trace.failed(error.code)  # after the response started: the record's and the span's error
            raise
        finally:
            await self._finish()

    async def aclose(self) -> None:
        """Close the upstream stream, release the deployment's slot, settle usage. Idempotent."""
        try:
            await self._release()
        finally:
            await self._ledger.settle(self._usage(), self._pricing())

    async def _send(self, deployment: Deployment, target: Target) -> tuple[Attempt, Json]:
        self._served_by, self._served_target = deployment, target  # the last attempt is the one that answered
        attempt = Attempt(self._context, self._endpoint, self._body, deployment, target)
        return attempt, await attempt.send()

    async def _open_stream(self, deployment: Deployment, target: Target) -> OpenStream:
        stream = await Attempt(self._context, self._endpoint, self._body, deployment, target).open_stream()
        self._stream, self._served_by, self._served_target = stream, deployment, target  # released by this call
        return stream

    def _note_answer(self, attempt: Attempt, data: Json) -> None:
        """The headers of the attempt that answered: its clamp report, and the upstream's own model name (the answer
        itself names the model's public id)."""
        if (trace := self._context.trace) is not None:
            trace.answered(attempt.deployment.name, self.served_model)
        clamped = attempt.clamped
        _set_header(self.headers, CLAMP_HEADER, None if clamped is None else clamp_header_value(clamped))
        _set_header(self.headers, UPSTREAM_MODEL_HEADER, upstream_model_header(name_model(data, self.served_model)))

    async def _finish(self) -> None:
        if not self.settles_late:
            await self.aclose()
            return
        try:
            await self._release()
        finally:
            # Queued now, before the response's last byte; `aclose()` waits for it.
            self._ledger.begin_settle(self._usage(), self._pricing())

    async def _release(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()
            if (trace := self._context.trace) is not None:  # closed, cut or not: the engine's stages it reached
                _trace_engine_stages(trace, stream.engine_stages())

    def _usage(self) -> Usage:
        if self._account is not None:
            return self._account.usage()
        return self._answer_usage or Usage()

    def _pricing(self) -> PricingConfig | None:
        """The price of this call: the serving deployment's, else that of the model it serves (a fallback's own,
        not the requested model's); None when neither has one."""
        if self._served_by is not None and self._served_by.config.pricing is not None:
            return self._served_by.config.pricing
        return self._served_target.route.config.pricing


def serves_natively(router: Router, model: str, endpoint: Endpoint) -> bool:
    """Whether every deployment of `model` serves `endpoint` itself (route families translate otherwise)."""
    target = router.find(model)
    return target is not None and all(d.backend.supports(endpoint) for d in target.route.deployments)


def _trace_engine_stages(trace: RequestTrace, stages: object) -> None:
    """The local engine's `[queued, scheduled, first token, finished]` (wall clock ns, 0 for a stage not reached), if
    that is what `stages` is, as the trace's spans (`backends.base.ENGINE_STAGES_KEY`)."""
    if isinstance(stages, list | tuple) and len(stages) == 4:
        times = [t for t in stages if type(t) is int]
        if len(times) == 4:
            trace.engine_stages(*times)


def _set_header(headers: dict[str, str], name: str, value: str | None) -> None:
    if value is None:
        headers.pop(name, None)
    else:
        headers[name] = value
