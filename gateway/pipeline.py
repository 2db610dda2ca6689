"""The one request flow every route family uses: credential → model → admission → router → backend.

    call = await open_call(request, endpoint="chat/completions", body=body, model=model, stream=stream)
    data = await call.json()                      # non-streaming
    async with aclosing(call.chunks()) as chunks: # streaming (the upstream is already open and answered)
        async for chunk in chunks: ...

Failures before the first byte (auth, 404, limits, every retry and fallback failing) raise from `open_call` /
`json()`, so the route can still answer with a proper status. Usage is settled and leases released exactly
once, in every outcome, by `json()` or by `chunks()`'s `finally` (also when the client disconnects); call
`aclose()` if you drop a streaming call without iterating it.

`call.settle_after_response()` lets the client have the response before the settle's Redis round trip is back
(when `Admission.settles_late`: no later admission can depend on it finishing first). The settle is still
queued before the last byte is handed over; the route then MUST run `aclose()` once the response is sent, which
waits for it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from starlette.requests import Request

from auth.base import AccessControl, Admission, SettleUsage, UpstreamLease, UpstreamLimiter, extract_credential
from backends.base import FORWARDED_HEADERS, Endpoint, Json
from backends.wire import usage_count
from gateway.disconnect import unless_disconnected
from gateway.errors import BackendError, GatewayError, InvalidRequestError, UpstreamTimeoutError, upstream_malformed
from gateway.estimates import CHARS_PER_TOKEN, answer_chars, estimate_prompt_tokens, has_counts
from gateway.metrics import GatewayMetrics
from gateway.normalize import (
    UPSTREAM_MODEL_HEADER,
    name_model,
    normalize_chunk,
    normalize_response,
    upstream_model_header,
)
from gateway.output_limits import (
    CLAMP_HEADER,
    clamp_for_upstream,
    clamp_header_value,
    reserved_output_tokens,
    take_backend_clamp,
)
from gateway.router import Deployment, Router, Target
from gateway.routing_config import PricingConfig
from gateway.settings import Settings
from gateway.validate import count_prompts

__all__ = ["Call", "open_call", "request_id_of", "serves_natively"]

logger = logging.getLogger("unigate.pipeline")

_USAGE_ENDPOINTS = ("chat/completions", "completions")
_MIN_REPORTED_WAIT_S = 0.05  # a shorter wait for an upstream slot is not worth a sentence in a 504's message


async def open_call(request: Request, *, endpoint: Endpoint, body: Json, model: str, stream: bool) -> Call:
    """Authenticate and admit the caller, resolve `model`, and (streaming) open the upstream stream."""
    state = request.app.state
    access: AccessControl = state.access
    limiter: UpstreamLimiter = state.upstream_limiter
    router: Router = state.router
    settings: Settings = state.settings
    credential = extract_credential(request.headers)
    target = router.find(model)
    if target is None:
        principal = await access.authenticate(credential)  # unknown callers learn nothing about models: 401
        router.resolve(model, visible=principal.may_use)  # raises 404 with close matches this caller may use
        raise AssertionError("unreachable")
    num_prompt_tokens = estimate_prompt_tokens(endpoint, body)
    num_max_tokens = 0
    if endpoint != "embeddings":
        # Every one of n choices may use max_tokens (as far as the context lets it: gateway/output_limits.py).
        per_choice = reserved_output_tokens(
            target.route.deployments,
            endpoint,
            body,
            num_prompt_tokens=num_prompt_tokens,
            fallback=settings.limits.default_max_tokens,
        )
        num_completions = _num_choices(body) * (count_prompts(body) if endpoint == "completions" else 1)
        num_max_tokens = per_choice * num_completions
    admission = await access.admit(
        credential,
        model=target.model_id,
        estimated_tokens=num_prompt_tokens + num_max_tokens,
        request_id=request_id_of(request),
    )
    scope_state = request.scope.setdefault("state", {})
    scope_state["model"] = target.model_id
    call = Call(
        access=access,
        limiter=limiter,
        router=router,
        settings=settings,
        metrics=state.metrics,
        admission=admission,
        target=target,
        endpoint=endpoint,
        body=body,
        request_id=request_id_of(request),
        num_prompt_tokens=num_prompt_tokens,
        started_at=scope_state.get("started_at") or time.perf_counter(),
        forwarded_headers=forwarded_headers(request),
    )
    if stream:
        try:
            await call.open_stream()
        except BaseException:
            await call.aclose()
            raise
    return call


class Call:
    """One admitted request on its way to a deployment; see the module docstring."""

    def __init__(
        self,
        *,
        access: AccessControl,
        limiter: UpstreamLimiter,
        router: Router,
        settings: Settings,
        metrics: GatewayMetrics,
        admission: Admission,
        target: Target,
        endpoint: Endpoint,
        body: Json,
        request_id: str,
        num_prompt_tokens: int,
        started_at: float,
        forwarded_headers: dict[str, str] | None = None,
    ) -> None:
        self.access = access
        self.limiter = limiter  # the deployments' max_in_flight slots
        self.router = router
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.target = target
        self.endpoint = endpoint
        self.body = body
        self.request_id = request_id
        self.forwarded_headers = forwarded_headers or None  # the client's headers backends may pass on
        self.headers: dict[str, str] = dict(admission.headers)
        self.started_at = started_at
        self._num_prompt_tokens = num_prompt_tokens
        self._num_completion_chars = 0
        self._usage: Json | None = None
        # Only OpenAI-family streams carry a usage chunk we add and may strip; other families pass untouched.
        self._strips_usage = endpoint in _USAGE_ENDPOINTS and not _wants_usage(body)
        self._upstream: AsyncIterator[Json] | None = None
        self._first: Json | None = None
        self._deployment: Deployment | None = None
        self._served_by: Deployment | None = None  # the deployment of a non-streaming answer (for its price)
        self._served_target = target  # the model that answered: the requested one, or a fallback (for its price)
        self._is_answered = False  # a non-streaming answer came back
        self._lease: UpstreamLease | None = None
        self._is_closed = False
        self._is_settle_queued = False  # exactly once per call
        self._settling: Awaitable[None] | None = None  # the queued settle, to wait for
        self._settles_late = False

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

        async def attempt(deployment: Deployment, target: Target) -> Json:
            self._served_by, self._served_target = deployment, target  # the last attempt is the one that answered
            return await self._send_attempt(deployment, target)

        try:
            data = await self.router.execute(self.target, attempt, may_use=self.admission.principal.may_use)
        except BaseException:
            await self.aclose()
            raise
        self._note_upstream_model(name_model(data, self.served_model))
        usage = data.get("usage")
        self._usage = usage if isinstance(usage, dict) else None
        self._is_answered = True
        if not has_counts(self._usage):
            self._num_completion_chars = answer_chars(data)  # charged as an estimate: see `_begin_settle`
        await self._finish()
        return data

    def settle_after_response(self) -> bool:
        """Queue the settle before the response ends but wait for it in `aclose()`, which the route runs after
        the response was sent — when the admission allows it (`Admission.settles_late`: the master key, or a key
        whose concurrency limit had a slot to spare; a key's next request on this instance queues behind the
        settle on the same Redis connection anyway). Returns whether the wait was deferred."""
        self._settles_late = self.admission.settles_late
        return self._settles_late

    async def chunks(self) -> AsyncGenerator[Json, None]:
        """The streamed chunks, validated/repaired; the usage chunk is stripped unless the client asked."""
        upstream = self._upstream
        if upstream is None:
            raise RuntimeError("chunks() needs a call opened with stream=True")
        try:
            first, self._first = self._first, None
            if first is not None:
                out = self._accept(first)
                self.metrics.ttft.labels(self.model).observe(time.perf_counter() - self.started_at)
                if out is not None:
                    yield out
            async for chunk in upstream:
                out = self._accept(normalize_chunk(self.endpoint, chunk))
                if out is not None:
                    yield out
        except GatewayError as error:
            if self._deployment is not None:
                self.router.record_failure(self._deployment, error, model=self._served_target.health_key)
                if isinstance(error, BackendError):
                    self._withhold_upstream_text(error, self._deployment, self._served_target)
            self.metrics.errors.labels(error.code).inc()
            raise
        finally:
            await self._finish()

    async def aclose(self) -> None:
        """Close the upstream stream, release the deployment and lease, settle usage. Idempotent."""
        try:
            await self._release_all()
        finally:
            settling = self._begin_settle()
            if settling is not None:
                try:
                    await settling
                except Exception:
                    logger.exception("could not settle usage for request %s", self.request_id)

    async def _finish(self) -> None:
        if self._settles_late:
            try:
                await self._release_all()
            finally:
                self._begin_settle()  # queued now, before the response's last byte; `aclose()` waits for it
        else:
            await self.aclose()

    async def _release_all(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        try:
            if self._upstream is not None:
                aclose = getattr(self._upstream, "aclose", None)
                if aclose is not None:
                    await aclose()
        finally:
            if self._deployment is not None:
                self._deployment.num_in_flight -= 1
            await self._release(self._lease)

    async def open_stream(self) -> None:
        # Waiting for the first chunk may take minutes: stop (and release everything) if the client goes away.
        attempts = self.router.execute(self.target, self._stream_attempt, may_use=self.admission.principal.may_use)
        upstream, first = await unless_disconnected(attempts)
        self._note_upstream_model(name_model(first, self.served_model))
        self._upstream, self._first = upstream, first

    # --- attempts (one per deployment try; the router retries / falls back around them) ----------------------

    async def _send_attempt(self, deployment: Deployment, target: Target) -> Json:
        body = self._upstream_body(deployment, target, stream=False)
        clamped = clamp_for_upstream(deployment, body)
        slot_wait_started = time.perf_counter()
        lease = await self._acquire(deployment)
        slot_wait_s = time.perf_counter() - slot_wait_started
        deployment.num_in_flight += 1
        started = time.perf_counter()
        outcome = "error"
        try:
            # A long generation: stop it (the lease is released below) if the client goes away meanwhile.
            send = deployment.backend.send(
                self.endpoint, body, request_id=self.request_id, headers=self.forwarded_headers
            )
            data = await unless_disconnected(send)
            self._note_clamp(take_backend_clamp(data) if isinstance(data, dict) else None, clamped)
            data = normalize_response(self.endpoint, data)
            outcome = "ok"
            return data
        except UpstreamTimeoutError as error:
            _add_slot_wait(error, slot_wait_s)
            raise
        except BackendError as error:
            self._withhold_upstream_text(error, deployment, target)
            raise
        finally:
            deployment.num_in_flight -= 1
            self.metrics.observe_upstream(deployment.name, outcome, time.perf_counter() - started)
            await self._release(lease)

    async def _stream_attempt(self, deployment: Deployment, target: Target) -> tuple[AsyncIterator[Json], Json]:
        body = self._upstream_body(deployment, target, stream=True)
        clamped = clamp_for_upstream(deployment, body)
        slot_wait_started = time.perf_counter()
        lease = await self._acquire(deployment)
        slot_wait_s = time.perf_counter() - slot_wait_started
        deployment.num_in_flight += 1
        started = time.perf_counter()
        upstream = deployment.backend.stream(
            self.endpoint, body, request_id=self.request_id, headers=self.forwarded_headers
        )
        try:
            try:
                first = await anext(upstream)
            except StopAsyncIteration:
                raise upstream_malformed("the stream ended before its first chunk") from None
            self._note_clamp(take_backend_clamp(first) if isinstance(first, dict) else None, clamped)
            first = normalize_chunk(self.endpoint, first)
        except BaseException as error:
            if isinstance(error, UpstreamTimeoutError):
                _add_slot_wait(error, slot_wait_s)
            elif isinstance(error, BackendError):
                self._withhold_upstream_text(error, deployment, target)
            deployment.num_in_flight -= 1
            self.metrics.observe_upstream(deployment.name, "error", time.perf_counter() - started)
            aclose = getattr(upstream, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._release(lease)
            raise
        self.metrics.observe_upstream(deployment.name, "ok", time.perf_counter() - started)
        self._deployment, self._lease, self._served_target = deployment, lease, target
        return upstream, first

    def _withhold_upstream_text(self, error: BackendError, deployment: Deployment, target: Target) -> None:
        """An upstream's own text about its failure goes to the log, with the request id; the client's message
        names the model and that id instead (the text may name internal hosts: backends.upstream_errors)."""
        if error.upstream_text is None:
            return
        logger.warning(
            "request %s: the upstream of deployment %s (model %s) failed: %s [%s]",
            self.request_id,
            deployment.name,
            target.model_id,
            error.upstream_text,
            error.code,
        )
        error.upstream_text = None  # logged once, even if the error passes here again
        error.message += (
            f" Model {target.model_id!r}, request id {self.request_id}: the upstream's message is in the gateway's "
            "log under this id."
        )

    def _note_upstream_model(self, name: object) -> None:
        """The upstream's own model name, from the answer (or the stream's first chunk), in a header."""
        value = upstream_model_header(name)
        if value is None:
            self.headers.pop(UPSTREAM_MODEL_HEADER, None)
        else:
            self.headers[UPSTREAM_MODEL_HEADER] = value

    def _note_clamp(self, *reports: tuple[int, int] | None) -> None:
        """The clamp header of the attempt that answered: the backend's own report, else the gateway's clamp."""
        clamped = next((report for report in reports if report is not None), None)
        if clamped is None:
            self.headers.pop(CLAMP_HEADER, None)
        else:
            self.headers[CLAMP_HEADER] = clamp_header_value(clamped)

    def _upstream_body(self, deployment: Deployment, target: Target, *, stream: bool) -> Json:
        if not deployment.backend.supports(self.endpoint):
            raise InvalidRequestError(
                f"Model {target.model_id!r} is served by a backend that does not support /v1/{self.endpoint}. "
                "Use an endpoint this model serves (e.g. /v1/chat/completions) or another model.",
                code="unsupported_endpoint",
            )
        body = dict(self.body)
        body["model"] = target.upstream_model(deployment)
        if stream:
            body["stream"] = True
            if self.endpoint in _USAGE_ENDPOINTS:  # usage is needed for accounting even if the client did not ask
                options = body.get("stream_options")
                body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return body

    async def _acquire(self, deployment: Deployment) -> UpstreamLease | None:
        max_in_flight = deployment.config.max_in_flight
        if max_in_flight is None:
            return None
        timeout_s = deployment.config.pool_timeout or self.settings.limits.pool_timeout_s
        return await self.limiter.acquire_upstream(deployment.name, max_in_flight=max_in_flight, timeout_s=timeout_s)

    async def _release(self, lease: UpstreamLease | None) -> None:
        if lease is None:
            return
        try:
            await self.limiter.release_upstream(lease)
        except Exception:
            logger.exception("could not release upstream lease for %s", lease.deployment)

    def _accept(self, chunk: Json) -> Json | None:
        """Name the model that served; capture usage and completion size; strip the usage the client did not ask
        for."""
        name_model(chunk, self.served_model)
        if "usage" in chunk:
            usage = chunk["usage"]
            if isinstance(usage, dict):
                self._usage = {**(self._usage or {}), **usage}
            if self._strips_usage:
                if not chunk.get("choices"):
                    return None
                del chunk["usage"]
        elif chunk.get("type") == "message_start":  # Anthropic events: input tokens arrive first
            message = chunk.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._usage = {**(self._usage or {}), **usage}
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or choice
            text = delta.get("content") if isinstance(delta, dict) else None
            if text is None and isinstance(delta, dict):
                text = delta.get("text")
            if isinstance(text, str):
                self._num_completion_chars += len(text)
        return chunk

    def _begin_settle(self) -> Awaitable[None] | None:
        """Queue the settle (the first time only) and return it; None when there is nothing (more) to wait for."""
        if self._is_settle_queued:
            settling, self._settling = self._settling, None
            return settling
        self._is_settle_queued = True
        usage = self._usage or {}
        # OpenAI names, else Anthropic / Responses names (Anthropic counts cached input tokens apart).
        num_prompt = usage_count(usage.get("prompt_tokens", usage.get("input_tokens")))
        if "prompt_tokens" not in usage:
            num_prompt += usage_count(usage.get("cache_read_input_tokens")) + usage_count(
                usage.get("cache_creation_input_tokens")
            )
        num_completion = usage_count(usage.get("completion_tokens", usage.get("output_tokens")))
        has_run = self._is_answered or (self._first is None and self._upstream is not None)
        if has_run and not has_counts(usage):
            # An answer (or a stream, perhaps cut short) without prompt/completion counts: charge what we can
            # estimate — its total when it gave one, split prompt-first.
            num_prompt = self._num_prompt_tokens
            num_completion = -(-self._num_completion_chars // CHARS_PER_TOKEN)
            if "total_tokens" in usage:
                num_total = usage_count(usage["total_tokens"])
                num_prompt = min(num_prompt, num_total)
                num_completion = num_total - num_prompt
        if num_prompt or num_completion:
            self.metrics.count_tokens(self.model, num_prompt, num_completion)
        pricing = self._pricing()
        try:
            settled = SettleUsage(
                prompt_tokens=num_prompt,
                completion_tokens=num_completion,
                cost_micros=pricing.cost_micros(num_prompt, num_completion) if pricing is not None else 0,
                is_priced=pricing is not None,
            )
            self._settling = self.access.begin_settle(self.admission, settled)
        except Exception:
            logger.exception("could not settle usage for request %s", self.request_id)
        return self._settling

    def _pricing(self) -> PricingConfig | None:
        """The price of this call: the serving deployment's, else that of the model it serves (a fallback's own,
        not the requested model's); None when neither has one."""
        deployment = self._deployment or self._served_by
        if deployment is not None and deployment.config.pricing is not None:
            return deployment.config.pricing
        return self._served_target.route.config.pricing


def _add_slot_wait(error: UpstreamTimeoutError, slot_wait_s: float) -> None:
    """A deployment's timeout counts from when the request is sent; a wait for one of its `max_in_flight` slots
    came before that. Say how long, so the 504's message adds up to the time the client saw."""
    if slot_wait_s >= _MIN_REPORTED_WAIT_S:
        error.message += (
            f" Before that, the request waited {slot_wait_s:.1f} s for a free slot of this deployment (max_in_flight)."
        )


_MAX_FORWARDED_HEADER_CHARS = 1024


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's `FORWARDED_HEADERS` that are short printable ASCII (a beta-flag list), for the backend."""
    forwarded = {}
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value and len(value) <= _MAX_FORWARDED_HEADER_CHARS and value.isascii() and value.isprintable():
            forwarded[name] = value
    return forwarded


def request_id_of(request: Request) -> str:
    state = request.scope.get("state") or {}
    request_id = state.get("request_id")
    return request_id if isinstance(request_id, str) else uuid.uuid4().hex


def serves_natively(request: Request, model: str, endpoint: Endpoint) -> bool:
    """Whether every deployment of `model` serves `endpoint` itself (route families translate otherwise)."""
    router: Router = request.app.state.router
    target = router.find(model)
    return target is not None and all(d.backend.supports(endpoint) for d in target.route.deployments)


def _wants_usage(body: Json) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _num_choices(body: Json) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
