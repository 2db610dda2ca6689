"""Which deployments are cooling down, and why: `Cooldowns`, the router's health bookkeeping.

A deployment that fails `max_fails` times in a row cools down for `cooldown_s`; one that answers 429 cools down at
once, for the upstream's Retry-After bounded by `max_retry_after_s` (`cooldown_s` when it sent none, or nothing
usable). On a wildcard route a failure about one upstream model cools that model down on the deployment
(`ModelHealth`), not the deployment, except a failure to connect, which no model has alone. The state lives on
each `gateway.router.Deployment` (the admin API and the console read it there); this class only changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.retry_after import parse_retry_after, retry_after_header
from gateway.errors import BackendError, GatewayError, UnavailableError, UpstreamRateLimitedError
from gateway.routing_config import RouterConfig

if TYPE_CHECKING:
    from gateway.router import Deployment, ModelRoute

__all__ = ["MAX_MODEL_STATES", "Cooldowns", "ModelHealth"]

MAX_MODEL_STATES = 1024  # per-model failure records a wildcard deployment keeps (the oldest go first)


@dataclass(slots=True)
class ModelHealth:
    """A wildcard deployment's health for one upstream model: a 429 or 5xx about `openai/gpt-4o` says nothing
    about `openai/gpt-4.1`, so it cools that model down, not the deployment."""

    num_fails: int = 0
    cooldown_until: float = 0.0
    is_rate_limited: bool = False  # the cooldown is a 429's: the upstream said when to come back


class Cooldowns:
    """Counts failures toward cooldowns and says which deployments are out (see the module docstring)."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock

    def record_success(self, deployment: Deployment, *, model: str | None = None) -> None:
        deployment.num_fails = 0
        health = deployment.health_of(model)
        if health is not None:
            health.num_fails = 0

    def record_failure(self, deployment: Deployment, error: GatewayError, *, model: str | None = None) -> None:
        """Count a failure toward a cooldown: the deployment's, or with `model` (a wildcard route's requested
        model) that model's on this deployment — except a failure to connect, which no model has alone."""
        if not isinstance(error, BackendError):
            return  # the caller's request or our own limits, not the deployment's health
        health: Deployment | ModelHealth = deployment
        if model is not None and error.code != "upstream_unreachable":
            health = self._model_health(deployment, model)
        health.num_fails += 1
        cooldown = self.config.cooldown_s
        is_rate_limited = error.code == "upstream_rate_limited"
        if is_rate_limited:
            retry_after = parse_retry_after(error.headers.get("retry-after"))
            if retry_after is not None:
                cooldown = min(retry_after, self.config.max_retry_after_s)
            error.headers["retry-after"] = retry_after_header(cooldown)  # the client's hint: when this one is back
        elif health.num_fails < self.config.max_fails:
            return
        health.cooldown_until = self._clock() + cooldown
        health.is_rate_limited = is_rate_limited
        health.num_fails = 0

    def lift_rate_limit(self, deployment: Deployment, model: str | None) -> None:
        """A deployment that answered after a 429: its 429 cooldown is over for everyone."""
        for health in (deployment, deployment.health_of(model)):
            if health is not None and health.is_rate_limited:
                health.cooldown_until = 0.0
                health.is_rate_limited = False

    def mark_down(self, deployment: Deployment) -> None:
        """Take a deployment out for one cooldown (a failed health probe)."""
        deployment.cooldown_until = self._clock() + self.config.cooldown_s
        deployment.is_rate_limited = False

    def is_cooling(self, deployment: Deployment) -> bool:
        return deployment.cooldown_until > self._clock()

    def is_available(self, deployment: Deployment, model: str | None, now: float) -> bool:
        """Whether `deployment` may be tried for `model` at `now` (neither it nor the model on it cooling)."""
        return self._cooling(deployment, model).cooldown_until <= now

    def all_cooling_error(self, route: ModelRoute, model: str | None = None) -> GatewayError:
        """503 `upstream_cooling_down`, or 429 `upstream_rate_limited` when every deployment is out after a 429."""
        coolings = [self._cooling(d, model) for d in route.deployments]
        wait = max(0.0, min(c.cooldown_until for c in coolings) - self._clock())
        seconds = max(1, int(wait + 0.999))
        if all(c.is_rate_limited for c in coolings):
            return UpstreamRateLimitedError(
                f"The upstream of model {model or route.id!r} is rate limiting the gateway (HTTP 429); retry in "
                f"{seconds} s.",
                headers={"retry-after": str(seconds)},
            )
        return UnavailableError(
            f"Every deployment of model {model or route.id!r} failed recently and is cooling down; retry in "
            f"{seconds} s.",
            code="upstream_cooling_down",
            headers={"retry-after": str(seconds)},
        )

    def _model_health(self, deployment: Deployment, model: str) -> ModelHealth:
        health = deployment.models.get(model)
        if health is None:
            if len(deployment.models) >= MAX_MODEL_STATES:
                now = self._clock()
                for name in [n for n, h in deployment.models.items() if h.cooldown_until <= now and not h.num_fails]:
                    del deployment.models[name]
                while len(deployment.models) >= MAX_MODEL_STATES:
                    del deployment.models[next(iter(deployment.models))]
            health = deployment.models[model] = ModelHealth()
        return health

    def _cooling(self, deployment: Deployment, model: str | None) -> Deployment | ModelHealth:
        """Whichever keeps the deployment out longer for `model`: its own cooldown or the model's on it."""
        health = deployment.health_of(model)
        return deployment if health is None or deployment.cooldown_until >= health.cooldown_until else health
