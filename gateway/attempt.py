"""One try of one deployment: the body it is sent, its `max_in_flight` slot, the send (or the stream up to its first
chunk), its timing and metrics. `Router.execute` decides around each attempt whether to retry, move on or fall back.

    data = await Attempt(context, endpoint, body, deployment, target).send()         # the slot is released after
    stream = await Attempt(context, endpoint, body, deployment, target).open_stream()  # held until stream.aclose()

Each call carries its caller's tenancy (tenant: the key's team, else the key; its weight and priority class), by which
the local engine shares itself; upstream backends ignore it.

A failure is explained for the client on its way out: a timeout says how long the request waited for the slot
before it was sent; an upstream's own text about its failure goes to the log with the request id, never to the
client (it may name internal hosts: backends.upstream_errors).

A deployment of a model with `slo:` first admits the attempt under its live limit (`DeploymentSlo.admit`, which may
wait in its fair queue or shed with 503 `overloaded`); the release hands the attempt's TTFT (the first chunk's, or
the whole answer's) and a stream's TPOT to its window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from auth.base import Principal, UpstreamLease
from backends.base import Endpoint, EngineStageTimes, Json, ReportsEngineStages, ReportsStreamUsage, Tenancy
from gateway.call_context import CallContext
from gateway.disconnect import unless_disconnected
from gateway.errors import BackendError, GatewayError, InvalidRequestError, UpstreamTimeoutError, upstream_malformed
from gateway.normalize import normalize_chunk, normalize_response
from gateway.output_limits import clamp_for_upstream, take_backend_clamp
from gateway.router import Deployment, Target
from gateway.slo_admission import SloTicket, TimedStream
from gateway.stream_accounting import USAGE_ENDPOINTS

__all__ = ["Attempt", "OpenStream", "tenancy_of"]

logger = logging.getLogger("unigate.pipeline")
_MIN_REPORTED_WAIT_S = 0.05  # a shorter wait for an upstream slot is not worth a sentence in a 504's message


class Attempt:
    """One deployment tried once for one request (see the module docstring)."""

    def __init__(
        self, context: CallContext, endpoint: Endpoint, body: Json, deployment: Deployment, target: Target
    ) -> None:
        self.deployment = deployment
        self.target = target  # the model tried: the requested one, or a fallback
        self.clamped: tuple[int, int] | None = None  # `(requested, served)` output limit of the answer, if lowered
        self._context = context
        self._endpoint = endpoint
        self._body = body  # the client's, never changed: each attempt sends its own copy
        self._lease: UpstreamLease | None = None
        self._is_holding = False  # counted in the deployment's in-flight requests (and holding the lease, if any)
        self._clamped_here: tuple[int, int] | None = None
        self._slot_wait_s = 0.0
        self._started = 0.0
        self._slo_ticket: SloTicket | None = None  # a place under the deployment's SLO limit, until released
        self._ttft_s: float | None = None  # this attempt's, once it answered (for the SLO window)
        self._timed: TimedStream | None = None  # an SLO model's stream, timed for its TPOT
        self._trace = context.trace  # the request log's and the spans' notes
        self._headers = context.forwarded_headers  # plus the attempt span's `traceparent` when tracing

    async def send(self) -> Json:
        """The answer, checked and repaired; the slot is released whatever happens."""
        body = await self._take_slot(stream=False)
        try:
            # A long generation: stop it (the slot is released below) if the client goes away meanwhile.
            send = self.deployment.backend.send(
                self._endpoint,
                body,
                request_id=self._context.request_id,
                headers=self._headers,
                tenancy=tenancy_of(self._context.principal),
            )
            data = await unless_disconnected(send)
            self._note_clamp(data)
            data = normalize_response(self._endpoint, data)
        except BaseException as error:
            self._explain(error)
            self._observe("error", error)
            await self.release()
            raise
        self._observe("ok")
        if self._slo_ticket is not None:
            self._ttft_s = time.perf_counter() - self._started  # non-streamed: TTFT = E2E
        await self.release()
        return data

    async def open_stream(self) -> OpenStream:
        """The stream, once its first chunk (checked and repaired) arrived; it holds the slot from then on."""
        body = await self._take_slot(stream=True)
        chunks = self.deployment.backend.stream(
            self._endpoint,
            body,
            request_id=self._context.request_id,
            headers=self._headers,
            tenancy=tenancy_of(self._context.principal),
        )
        try:
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                raise upstream_malformed("the stream ended before its first chunk") from None
            self._note_clamp(first)
            first = normalize_chunk(self._endpoint, first)
        except BaseException as error:
            self._explain(error)
            self._observe("error", error)
            try:
                await _aclose(chunks)
            finally:
                await self.release()
            raise
        self._observe("ok")
        if self._slo_ticket is not None:
            first_at = time.perf_counter()
            self._ttft_s = first_at - self._started
            chunks = self._timed = TimedStream(chunks, first_at)
        return OpenStream(self, chunks, first)

    def record_stream_failure(self, error: GatewayError) -> None:
        """A stream that broke after its first chunk: it counts against the deployment (or the wildcard model on
        it), and the upstream's text is withheld as for any failure."""
        self._context.router.record_failure(self.deployment, error, model=self.target.health_key)
        if isinstance(error, BackendError):
            self._withhold_upstream_text(error)
        self._context.metrics.errors.labels(error.code).inc()

    async def release(self) -> None:
        """Give the deployment's slot back. Idempotent."""
        if self._slo_ticket is not None:
            self._release_slo()
        if not self._is_holding:
            return
        self._is_holding = False
        self.deployment.num_in_flight -= 1
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self._context.limiter.release_upstream(lease)
        except Exception:
            logger.exception("could not release upstream lease for %s", lease.deployment)

    async def _take_slot(self, *, stream: bool) -> Json:
        """Every attempt's preamble: the body for this deployment, then one of its `max_in_flight` slots (timed:
        a timeout's message counts the wait), then the clock for the upstream metrics."""
        body = self._upstream_body(stream=stream)
        self._clamped_here = clamp_for_upstream(self.deployment, body)
        if self._trace is not None:
            traceparent = self._trace.attempt_started(self.deployment.name, _base_url(self.deployment))
            if traceparent:
                self._headers = {**(self._headers or {}), **traceparent}
        wait_started = time.perf_counter()
        try:
            if (slo := self.deployment.slo) is not None:
                self._slo_ticket = await slo.admit(self._context.principal)
            self._lease = await self._acquire()
        except BaseException as error:
            self._observe("error", error)
            if self._slo_ticket is not None:
                self._release_slo()
            raise
        self._slot_wait_s = time.perf_counter() - wait_started
        if self._trace is not None and self.deployment.config.max_in_flight is not None:
            self._trace.slot_waited(wait_started, wait_started + self._slot_wait_s)
        self.deployment.num_in_flight += 1
        self._is_holding = True
        self._started = time.perf_counter()
        return body

    def _release_slo(self) -> None:
        """The place under the SLO limit back, with this attempt's latency when it answered."""
        ticket, self._slo_ticket = self._slo_ticket, None
        slo = self.deployment.slo
        if ticket is None or slo is None:
            return
        tpot_s = self._timed.tpot_s() if self._timed is not None else None
        slo.release(ticket, self._ttft_s, tpot_s)

    def _upstream_body(self, *, stream: bool) -> Json:
        if not self.deployment.backend.supports(self._endpoint):
            raise InvalidRequestError(
                f"Model {self.target.model_id!r} is served by a backend that does not support /v1/{self._endpoint}. "
                "Use an endpoint this model serves (e.g. /v1/chat/completions) or another model.",
                code="unsupported_endpoint",
            )
        body = dict(self._body)
        body["model"] = self.target.upstream_model(self.deployment)
        if stream:
            body["stream"] = True
            if self._endpoint in USAGE_ENDPOINTS:  # usage is needed for accounting even if the client did not ask
                options = body.get("stream_options")
                body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return body

    async def _acquire(self) -> UpstreamLease | None:
        config = self.deployment.config
        if config.max_in_flight is None:
            return None
        timeout_s = config.pool_timeout or self._context.settings.limits.pool_timeout_s
        principal = self._context.principal
        return await self._context.limiter.acquire_upstream(
            self.deployment.name,
            max_in_flight=config.max_in_flight,
            timeout_s=timeout_s,
            tenant=principal.tenant,
            weight=principal.weight,
            priority=principal.priority,
        )

    def _note_clamp(self, data: object) -> None:
        """The answer's clamp report: the backend's own (removed from its answer), else the gateway's clamp."""
        reported = take_backend_clamp(data) if isinstance(data, dict) else None
        self.clamped = reported if reported is not None else self._clamped_here

    def _observe(self, outcome: str, error: BaseException | None = None) -> None:
        elapsed = time.perf_counter() - self._started if self._started else 0.0
        if self._started:
            self._context.metrics.observe_upstream(self.deployment.name, outcome, elapsed)
        if self._trace is not None:
            if error is None:
                self._trace.attempted(self.deployment.name, 200, elapsed)
            elif isinstance(error, GatewayError):
                self._trace.attempted(self.deployment.name, error.status_code, elapsed, error.code)
            else:  # cancelled (the client left, a deadline) or a bug of ours
                reason = "cancelled" if isinstance(error, asyncio.CancelledError) else "internal_error"
                self._trace.attempted(self.deployment.name, 0, elapsed, reason)

    def _explain(self, error: BaseException) -> None:
        if isinstance(error, UpstreamTimeoutError):
            # The deployment's timeout counts from when the request was sent; a wait for its slot came before.
            if self._slot_wait_s >= _MIN_REPORTED_WAIT_S:
                error.message += (
                    f" Before that, the request waited {self._slot_wait_s:.1f} s for a free slot of this deployment "
                    "(max_in_flight)."
                )
        elif isinstance(error, BackendError):
            self._withhold_upstream_text(error)

    def _withhold_upstream_text(self, error: BackendError) -> None:
        """An upstream's own text about its failure goes to the log, with the request id; the client's message
        names the model and that id instead."""
        if error.upstream_text is None:
            return
        request_id = self._context.request_id
        logger.warning(
            "request %s: the upstream of deployment %s (model %s) failed: %s [%s]",
            request_id,
            self.deployment.name,
            self.target.model_id,
            error.upstream_text,
            error.code,
        )
        error.upstream_text = None  # logged once, even if the error passes here again
        error.message += (
            f" Model {self.target.model_id!r}, request id {request_id}: the upstream's message is in the gateway's "
            "log under this id."
        )


@dataclass(slots=True)
class OpenStream:
    """A stream whose first chunk arrived: it holds its attempt's slot until `aclose()`."""

    attempt: Attempt
    chunks: AsyncIterator[Json]
    first: Json | None  # the first chunk, until the pipeline takes it

    async def aclose(self) -> None:
        try:
            await _aclose(self.chunks)
        finally:
            await self.attempt.release()

    def usage_so_far(self) -> Json | None:
        """The backend's own count of what the stream used so far (exact also once closed early), where its stream
        keeps one (`ReportsStreamUsage`: the local engine); else None."""
        chunks = self.chunks
        return chunks.usage_so_far() if isinstance(chunks, ReportsStreamUsage) else None

    def engine_stages(self) -> EngineStageTimes | None:
        """When its request reached each stage in the local engine, where its stream says (`ReportsEngineStages`)."""
        chunks = self.chunks
        return chunks.engine_stages() if isinstance(chunks, ReportsEngineStages) else None


def tenancy_of(principal: Principal) -> Tenancy:
    """Whose share of the local engine serves the caller: its tenant (team, else key), weight and priority."""
    return Tenancy(principal.tenant, principal.weight, principal.priority)


def _base_url(deployment: Deployment) -> str | None:
    """The upstream's base URL (its host is a span's `server.address`); None for the local engine."""
    base_url = getattr(deployment.config, "base_url", None)
    return base_url if isinstance(base_url, str) else None


async def _aclose(chunks: AsyncIterator[Json]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
