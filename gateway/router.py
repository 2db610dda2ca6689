"""Model id / alias / wildcard → deployments, and the retry / fallback loop around one call (the cooldowns it
obeys are kept by `gateway.cooldowns.Cooldowns`).

Pick: among the deployments not cooling down, the one with the fewest in-flight requests per unit of weight
(ties broken by weighted chance). Retries (connect errors, 429, 5xx) move to the next deployment of the same
model with exponential backoff and jitter; when a model's attempts are spent the configured fallback models
are tried in order. A deployment that is at capacity (no `max_in_flight` slot within its `pool_timeout`) is not
tried again by the same request: that wait was already spent once, so only its other deployments and the
fallbacks are tried. A deployment that fails `max_fails` times in a row (or answers 429) cools down; after a 429 for
the upstream's Retry-After bounded by `max_retry_after_s` (`cooldown_s` when it sent none, or nothing usable).

A model that sets `routing:` (`round_robin`, `least_load`, `prefix_affinity`) picks among the same available
deployments by that policy instead (gateway/routing_policies.py); `execute` then takes the request's body and
session id, from which `prefix_affinity` makes its key (gateway/prefix_hash.py). Under `least_load` and
`prefix_affinity` a deployment whose replica stopped answering its metrics is not available. Retries, fallbacks,
cooldowns and at-capacity handling are the same under every policy.

A model with `slo:` gives each deployment a live concurrency limit and a fair queue (`Deployment.slo`,
gateway/slo_admission.py): the pick prefers deployments with room under their limit and, when none has, the one
whose queue is shortest per unit of limit; the attempt then waits there for its place (or is shed, 503
`overloaded`: not retried, no fallback, no cooldown). A model without `slo` costs the pick one `is None` test.

A 429 is retried even when no other deployment is left (a model with one deployment): the request that got it
waits the upstream's Retry-After when that is at most `max_backoff_s` (the usual backoff when it sent none), then
tries that deployment again; a longer Retry-After is the client's to wait, so the upstream's 429 goes back with it.
A request that finds every deployment of its model cooling after a 429 gets 429 `upstream_rate_limited` with the
time left, not 503 `upstream_cooling_down`: the upstream said when to come back.
"""

from __future__ import annotations

import asyncio
import difflib
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from backends.base import Backend, Json
from backends.retry_after import parse_retry_after
from gateway.cooldowns import Cooldowns, ModelHealth
from gateway.errors import BackendError, GatewayError, NotFoundError
from gateway.routing_config import (
    DeploymentConfig,
    ModelConfig,
    PricingConfig,
    RouterConfig,
    RoutingConfig,
    RoutingPolicy,
)
from gateway.routing_policies import ReplicaLoad, is_reachable, pick_by_policy, request_key
from gateway.slo_admission import DeploymentSlo, with_room

__all__ = ["Deployment", "ModelRoute", "Router", "Target"]

T = TypeVar("T")

# Worth another attempt (on another deployment when there is one): the upstream may answer next time.
_RETRIABLE = frozenset(
    {"upstream_unreachable", "upstream_error", "upstream_rate_limited", "upstream_at_capacity", "upstream_overloaded"}
)
# Worth another attempt on another deployment only: retrying the same one would wait its pool_timeout again.
_NOT_AGAIN = frozenset({"upstream_at_capacity"})


@dataclass(slots=True)
class Deployment:
    config: DeploymentConfig
    backend: Backend
    num_in_flight: int = 0
    num_fails: int = 0
    cooldown_until: float = 0.0
    is_rate_limited: bool = False  # the cooldown is a 429's (see `ModelHealth`)
    models: dict[str, ModelHealth] = field(default_factory=dict)  # wildcard routes: health per requested model
    replica: ReplicaLoad = field(default_factory=ReplicaLoad)  # its `metrics_url`'s last report (least_load)
    slo: DeploymentSlo | None = None  # the model's `slo`: its live limit, window and queue

    def health_of(self, model: str | None) -> ModelHealth | None:
        return None if model is None else self.models.get(model)

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(slots=True)
class ModelRoute:
    config: ModelConfig
    deployments: list[Deployment] = field(default_factory=list)
    num_picks: int = 0  # `routing: round_robin`'s position
    placements: OrderedDict[bytes, str] = field(default_factory=OrderedDict)  # prefix_affinity: key -> deployment
    # prefix_affinity: told of each move (a key sent elsewhere than before, or a new key off its first choice), to
    # share it with the other gateway instances (gateway/placement_sync.py)
    on_move: Callable[[ModelRoute, bytes, str], None] | None = None
    # Read once here, so that the default policy costs a request one attribute test: None for `least_in_flight`.
    policy: RoutingPolicy | None = field(init=False)
    reads_replicas: bool = field(init=False)  # least_load, prefix_affinity: the replicas' own load (`metrics_url`)
    has_slo: bool = field(init=False)  # the model's `slo`: deployments admit under their live limits

    def __post_init__(self) -> None:
        self.policy = None if self.config.routing == "least_in_flight" else self.config.routing
        self.reads_replicas = self.policy in ("least_load", "prefix_affinity")
        slo = self.config.slo
        self.has_slo = slo is not None
        if slo is not None:
            for deployment in self.deployments:
                seed = deployment.config.max_concurrency or self.config.seed_concurrency
                deployment.slo = DeploymentSlo(slo, seed, name=deployment.name)

    @property
    def id(self) -> str:
        return self.config.id


@dataclass(frozen=True, slots=True)
class Target:
    """A resolved request model: `model_id` is the canonical public name (an alias resolves to its id; a
    wildcard keeps the requested `openai/<x>`), `requested` is what the client sent."""

    model_id: str
    requested: str
    route: ModelRoute

    @property
    def health_key(self) -> str | None:
        """The model a wildcard route's failures are counted for (None: the deployment's own health)."""
        return self.model_id if self.route.config.is_wildcard else None

    def upstream_model(self, deployment: Deployment) -> str:
        return deployment.config.upstream_model(self.requested if self.route.config.is_wildcard else self.model_id)


class Router:
    def __init__(
        self,
        config: RoutingConfig,
        backends: Mapping[str, Backend],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config: RouterConfig = config.router
        self.fallbacks = config.fallbacks
        self.cooldowns = Cooldowns(config.router, clock)
        self._clock = clock
        self.routes: list[ModelRoute] = []
        self._by_name: dict[str, ModelRoute] = {}
        self._wildcards: list[ModelRoute] = []
        for model in config.models:
            route = ModelRoute(model, [Deployment(d, backends[d.name]) for d in model.deployments])
            self.routes.append(route)
            if model.is_wildcard:
                self._wildcards.append(route)
            else:
                for name in (model.id, *model.aliases):
                    self._by_name[name] = route
        self._wildcards.sort(key=lambda r: len(r.id), reverse=True)  # the most specific prefix wins

    @property
    def deployments(self) -> list[Deployment]:
        return [d for route in self.routes for d in route.deployments]

    def find(self, model: str) -> Target | None:
        route = self._by_name.get(model)
        if route is not None:
            return Target(route.id, model, route)
        for route in self._wildcards:
            prefix = route.id[:-1]
            if model.startswith(prefix) and len(model) > len(prefix):
                return Target(model, model, route)
        return None

    def resolve(self, model: str, *, visible: Callable[[str], bool] | None = None) -> Target:
        """The target for `model`, or 404 `model_not_found` listing close matches the caller may use."""
        target = self.find(model)
        if target is not None:
            return target
        raise self.not_found(model, visible=visible)

    def not_found(self, model: str, *, visible: Callable[[str], bool] | None = None) -> NotFoundError:
        """404 `model_not_found` naming up to three close matches: model ids and aliases, and a wildcard as its
        form (`'openai/<model>'`, matched on its prefix plus the rest of the request), never as a pattern."""
        candidates: dict[str, str] = {}  # what is compared with `model` -> what the message shows
        for name in self.public_names():
            if visible is None or visible(name):
                candidates.setdefault(name, repr(name))
        for route in self._wildcards:
            if visible is None or visible(route.id):
                prefix = route.id[:-1]
                rest = model.split("/", 1)[1] if "/" in prefix and "/" in model else model
                candidates.setdefault(prefix + rest, f"'{prefix}<model>'")
        matches = difflib.get_close_matches(model, list(candidates), n=3, cutoff=0.5)
        shown = list(dict.fromkeys(candidates[m] for m in matches))
        hint = f" Did you mean {', '.join(shown)}?" if shown else ""
        return NotFoundError(
            f"The model {model!r} does not exist on this gateway.{hint} GET /v1/models lists the models you can use.",
            code="model_not_found",
            param="model",
        )

    def public_names(self) -> list[str]:
        """Model ids and aliases a client can send as they are (wildcard patterns are not among them)."""
        names: list[str] = []
        for route in self.routes:
            if not route.config.is_wildcard:
                names.append(route.id)
            names.extend(route.config.aliases)
        return names

    async def execute(
        self,
        target: Target,
        attempt: Callable[[Deployment, Target], Awaitable[T]],
        *,
        may_use: Callable[[str], bool] | None = None,
        body: Json | None = None,
        session_id: str | None = None,
    ) -> T:
        """Run `attempt` on deployments of `target` (then of its fallbacks that `may_use` allows: a key restricted
        to some models is never served, nor charged, by another) until one succeeds. `body` and `session_id` (the
        client's `x-session-id`) key `routing: prefix_affinity`; other policies ignore them."""
        last_error: GatewayError | None = None
        for current in self._chain(target, may_use):
            key = None if current.route.policy is None else request_key(current.route.config, body, session_id)
            tried: set[str] = set()
            spent: set[str] = set()  # deployments this request must not try again (see `_NOT_AGAIN`)
            rate_limited: tuple[Deployment, float] | None = None  # the last 429's deployment, and the wait it asked
            for attempt_number in range(1 + self.config.num_retries):
                model = current.health_key
                deployment = self.pick(current.route, exclude=tried, skip=spent, model=model, key=key)
                wait = self._backoff(attempt_number) if attempt_number > 0 else 0.0
                is_after_429 = deployment is None and rate_limited is not None
                if deployment is None and rate_limited is not None:
                    deployment, wait = rate_limited  # nothing else left: wait its 429 out, then try it again
                if deployment is None:
                    last_error = last_error or self.cooldowns.all_cooling_error(current.route, model)
                    break
                rate_limited = None
                if wait > 0:
                    await asyncio.sleep(wait)
                tried.add(deployment.name)
                try:
                    result = await attempt(deployment, current)
                except GatewayError as error:
                    retry_after = parse_retry_after(error.headers.get("retry-after"))  # the upstream's, as it sent it
                    self.record_failure(deployment, error, model=model)
                    last_error = error
                    if error.code not in _RETRIABLE:
                        break
                    if error.code in _NOT_AGAIN:
                        spent.add(deployment.name)
                    elif error.code == "upstream_rate_limited":
                        rate_limited = self._after_429(deployment, retry_after, attempt_number + 1, spent)
                    continue
                self.record_success(deployment, model=model)
                if is_after_429:
                    self.cooldowns.lift_rate_limit(
                        deployment, model
                    )  # it answered: its 429 cooldown is over for everyone
                return result
            if last_error is not None and not _may_fall_back(last_error):
                raise last_error
        assert last_error is not None  # the chain always holds `target`, which made at least one decision
        raise last_error

    def pick(
        self,
        route: ModelRoute,
        *,
        exclude: Iterable[str] = (),
        skip: Iterable[str] = (),
        model: str | None = None,
        key: bytes | None = None,
    ) -> Deployment | None:
        """Least in-flight per unit of weight among available deployments (or the route's `routing` policy's
        choice), preferring ones not in `exclude` (already tried) and never one in `skip`; None when none is left.
        `model`: the requested model of a wildcard route, whose own cooldown counts too. `key`: the request's
        affinity key (`routing: prefix_affinity`)."""
        now = self._clock()
        skipped = set(skip)
        available = [
            d for d in route.deployments if self.cooldowns.is_available(d, model, now) and d.name not in skipped
        ]
        if route.reads_replicas:
            available = [d for d in available if is_reachable(d)]
        if not available:
            return None
        fresh = [d for d in available if d.name not in exclude] or available
        if route.has_slo:
            fresh = with_room(fresh)
        if len(fresh) == 1:
            return fresh[0]
        if route.policy is not None:
            return pick_by_policy(route, fresh, key, now, self.config.metrics_stale_s)
        best = min(d.num_in_flight / d.config.weight for d in fresh)
        ties = [d for d in fresh if d.num_in_flight / d.config.weight == best]
        return random.choices(ties, weights=[d.config.weight for d in ties])[0]

    def _after_429(
        self, deployment: Deployment, retry_after: float | None, attempt_number: int, spent: set[str]
    ) -> tuple[Deployment, float] | None:
        """The wait before this request may try a deployment that answered 429 again: the upstream's Retry-After
        when it is at most `max_backoff_s` (the usual backoff when it sent none); None, and never again for this
        request, when it asked for longer (the client gets the 429 and its Retry-After)."""
        if retry_after is None:
            return deployment, self._backoff(attempt_number)
        if retry_after <= self.config.max_backoff_s:
            return deployment, retry_after
        spent.add(deployment.name)
        return None

    def record_success(self, deployment: Deployment, *, model: str | None = None) -> None:
        self.cooldowns.record_success(deployment, model=model)

    def record_failure(self, deployment: Deployment, error: GatewayError, *, model: str | None = None) -> None:
        """Count a failure toward a cooldown (`Cooldowns.record_failure`)."""
        self.cooldowns.record_failure(deployment, error, model=model)

    def mark_down(self, deployment: Deployment) -> None:
        """Take a deployment out for one cooldown (a failed health probe)."""
        self.cooldowns.mark_down(deployment)

    def is_cooling(self, deployment: Deployment) -> bool:
        return self.cooldowns.is_cooling(deployment)

    def prices(self, target: Target) -> list[tuple[str, list[PricingConfig | None]]]:
        """Per model that may serve `target` (itself, then every configured fallback: the key's allowlist picks
        among them at admission), the pricing of each of its deployments (None: unpriced)."""
        return [
            (current.model_id, [d.config.pricing or current.route.config.pricing for d in current.route.deployments])
            for current in self._chain(target, None)
        ]

    def _chain(self, target: Target, may_use: Callable[[str], bool] | None) -> list[Target]:
        chain = [target]
        names = self.fallbacks.get(target.requested) or self.fallbacks.get(target.route.id) or []
        for name in names:
            fallback = self.find(name)
            if fallback is None or fallback.route is target.route:
                continue
            if may_use is None or may_use(fallback.model_id):
                chain.append(fallback)
        return chain

    def _backoff(self, attempt_number: int) -> float:
        ceiling: float = min(self.config.max_backoff_s, self.config.retry_backoff_s * 2.0 ** (attempt_number - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # "equal jitter": spread retries, keep a floor


def _may_fall_back(error: GatewayError) -> bool:
    return isinstance(error, BackendError) or error.code in ("upstream_at_capacity", "upstream_cooling_down")
