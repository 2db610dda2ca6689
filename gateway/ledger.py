"""One request's account with access control: estimate, reserve (the admission), settle exactly once.

    ledger = await Ledger.admit(context, target, endpoint=..., body=...)   # ONE Redis round trip
    ...                                                                     # the attempts; the answer reports usage
    ledger.begin_settle(usage, pricing)       # queued (the first call only), e.g. before the response's last byte
    await ledger.settle(usage, pricing)       # queued if it was not yet, then waited for

Admission reserves the estimated prompt plus every choice's output limit (gateway/output_limits.py) and takes the
key's concurrency lease; a budgeted key also holds the request's worst case against its budgets (`budget_cost`: a
prompt bound that never undercounts plus every output, priced at the dearest model that may serve it). The settle
replaces the reservation and the hold with the charge (`Settlement`) and releases that lease, in every outcome. The
charge is the usage the upstream reported (`Usage`), else an estimate marked as one: the prompt bound and the
generated text at `CHARS_PER_TOKEN`. Upstream `max_in_flight` slots are the attempt's
(gateway/attempt.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from auth.base import AccessControl, Admission, BudgetCost, SettleUsage
from backends.base import Endpoint, Json
from backends.wire import usage_count
from gateway.call_context import CallContext
from gateway.estimates import CHARS_PER_TOKEN, answer_chars, estimate_prompt_tokens, has_counts, prompt_token_bound
from gateway.metrics import GatewayMetrics
from gateway.output_limits import reserved_output_tokens
from gateway.request_fields import count_prompts
from gateway.request_trace import NO_STAGE, RequestTrace
from gateway.router import Router, Target
from gateway.routing_config import PricingConfig

__all__ = ["Ledger", "Settlement", "Usage", "budget_cost"]

logger = logging.getLogger("unigate.pipeline")


@dataclass(frozen=True, slots=True)
class Usage:
    """What a request used, as the pipeline saw it: what the ledger settles."""

    reported: Json | None = None  # the upstream's usage object (a stream's, merged over its chunks), any family's names
    num_completion_chars: int = 0  # generated text seen: the estimate when `reported` has no counts
    has_run: bool = False  # an answer came back or a stream started: without counts it is charged an estimate
    is_cut: bool = False  # a stream that ended before its end: without counts its prompt is charged the bound

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from a cache, as reported (OpenAI's `prompt_tokens_details`, Anthropic's
        `cache_read_input_tokens`); 0 when not."""
        reported = self.reported or {}
        details = reported.get("prompt_tokens_details", reported.get("input_tokens_details"))
        if isinstance(details, dict):
            return usage_count(details.get("cached_tokens"))
        return usage_count(reported.get("cache_read_input_tokens"))

    @classmethod
    def of_answer(cls, data: Json) -> Usage:
        usage = data.get("usage")
        reported = usage if isinstance(usage, dict) else None
        return cls(reported, 0 if has_counts(reported) else answer_chars(data), has_run=True)


@dataclass(frozen=True, slots=True)
class Settlement:
    """What the ledger charges for one request: the usage access control settles, and how it was arrived at."""

    usage: SettleUsage
    is_estimated: bool = False  # the upstream reported no counts: charged the estimate

    @classmethod
    def of(
        cls, usage: Usage, *, num_prompt_estimate: int, pricing: PricingConfig | None, num_prompt_bound: int = 0
    ) -> Settlement:
        """`num_prompt_bound` (never below the real count) is a cut stream's prompt charge; an answer that ended
        without counts is charged `num_prompt_estimate`."""
        reported = usage.reported or {}
        # OpenAI names, else Anthropic / Responses names (Anthropic counts cached input tokens apart).
        num_prompt = usage_count(reported.get("prompt_tokens", reported.get("input_tokens")))
        if "prompt_tokens" not in reported:
            num_prompt += usage_count(reported.get("cache_read_input_tokens")) + usage_count(
                reported.get("cache_creation_input_tokens")
            )
        num_completion = usage_count(reported.get("completion_tokens", reported.get("output_tokens")))
        is_estimated = usage.has_run and not has_counts(reported)
        if is_estimated:
            # An answer (or a stream, perhaps cut short) without prompt/completion counts: charge what we can
            # estimate — its total when it gave one, split prompt-first.
            num_prompt = max(num_prompt_bound, num_prompt_estimate) if usage.is_cut else num_prompt_estimate
            num_completion = -(-usage.num_completion_chars // CHARS_PER_TOKEN)
            if "total_tokens" in reported:
                num_total = usage_count(reported["total_tokens"])
                num_prompt = min(num_prompt, num_total)
                num_completion = num_total - num_prompt
        settled = SettleUsage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            cost_micros=pricing.cost_micros(num_prompt, num_completion) if pricing is not None else 0,
            is_priced=pricing is not None,
            is_estimated=is_estimated,
        )
        return cls(settled, is_estimated)


class Ledger:
    """One admitted request's reservation, settled exactly once (see the module docstring)."""

    def __init__(
        self,
        *,
        access: AccessControl,
        metrics: GatewayMetrics,
        admission: Admission,
        model: str,
        num_prompt_tokens: int,
        request_id: str,
        num_prompt_bound: int = 0,
        trace: RequestTrace | None = None,
    ) -> None:
        self.admission = admission
        self.model = model  # the requested model's public id: the token metrics' label
        self.num_prompt_tokens = num_prompt_tokens  # the admission's estimate (the TPM reservation's)
        # Never below the real count (gateway/estimates.py): what a cut stream or an answer without counts is charged.
        self.num_prompt_bound = max(num_prompt_bound, num_prompt_tokens)
        self.settlement: Settlement | None = None  # what was charged, once the settle is queued
        self._access = access
        self._metrics = metrics
        self._request_id = request_id
        self._settling: Awaitable[None] | None = None  # the queued settle, until someone waits for it
        self._trace = trace  # the request log's and the spans' notes (gateway/request_trace.py)

    @classmethod
    async def admit(cls, context: CallContext, target: Target, *, endpoint: Endpoint, body: Json) -> Ledger:
        """Estimate the request and reserve it: 403 for a model the key may not use, 429 / 503 for its limits."""
        num_prompt_tokens = estimate_prompt_tokens(endpoint, body)
        num_prompt_bound = prompt_token_bound(endpoint, body)
        num_max_tokens = 0
        if endpoint != "embeddings":
            # Every one of n choices may use max_tokens (as far as the context lets it: gateway/output_limits.py).
            per_choice = reserved_output_tokens(
                target.route.deployments,
                endpoint,
                body,
                num_prompt_tokens=num_prompt_tokens,
                fallback=context.settings.limits.default_max_tokens,
            )
            num_completions = _num_choices(body) * (count_prompts(body) if endpoint == "completions" else 1)
            num_max_tokens = per_choice * num_completions
        trace = context.trace
        with trace.stage("unigate.admission") if trace is not None else NO_STAGE:
            admission = await context.access.admit(
                context.credential,
                model=target.model_id,
                estimated_tokens=num_prompt_tokens + num_max_tokens,
                request_id=context.request_id,
                budget=budget_cost(context.router, target, num_prompt_bound, num_max_tokens),
            )
        return cls(
            access=context.access,
            metrics=context.metrics,
            admission=admission,
            model=target.model_id,
            num_prompt_tokens=num_prompt_tokens,
            num_prompt_bound=num_prompt_bound,
            request_id=context.request_id,
            trace=trace,
        )

    @property
    def may_use(self) -> Callable[[str], bool]:
        """Whether the caller may be served by a model (fallbacks it may not use are skipped)."""
        return self.admission.principal.may_use

    def begin_settle(self, usage: Usage, pricing: PricingConfig | None) -> None:
        """Queue the settle, the first time only (later calls, with whatever usage, change nothing)."""
        if self.settlement is not None:
            return
        settlement = self.settlement = Settlement.of(
            usage, num_prompt_estimate=self.num_prompt_tokens, pricing=pricing, num_prompt_bound=self.num_prompt_bound
        )
        settled = settlement.usage
        if self._trace is not None:
            self._trace.settled(settled, usage.num_cached_tokens)
        if settled.prompt_tokens or settled.completion_tokens:
            self._metrics.count_tokens(self.model, settled.prompt_tokens, settled.completion_tokens)
        try:
            self._settling = self._access.begin_settle(self.admission, settled)
        except Exception:
            logger.exception("could not settle usage for request %s", self._request_id)

    async def settle(self, usage: Usage, pricing: PricingConfig | None) -> None:
        """`begin_settle`, then wait for it (once: a second call has nothing left to wait for). Never raises for
        the settle itself: a failure is logged."""
        self.begin_settle(usage, pricing)
        settling, self._settling = self._settling, None
        if settling is None:
            return
        try:
            await settling
        except Exception:
            logger.exception("could not settle usage for request %s", self._request_id)
        finally:
            if self._trace is not None:
                self._trace.settle_done()


def budget_cost(router: Router, target: Target, num_prompt_tokens: int, num_output_tokens: int) -> BudgetCost:
    """The hold of a request on a budgeted key: its worst-case tokens, and its worst-case cost on each model that
    may serve it (the dearest of the model's deployments; the admission script picks the dearest model the key may
    use)."""
    costs = tuple(
        (
            model_id,
            max(
                (p.cost_micros(num_prompt_tokens, num_output_tokens) for p in pricings if p is not None),
                default=0,
            ),
        )
        for model_id, pricings in router.prices(target)
    )
    return BudgetCost(num_prompt_tokens + num_output_tokens, costs)


def _num_choices(body: Json) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
