"""What wildcard routes serve, for `GET /v1/models`: each wildcard deployment's upstream model list, cached.

A route such as `openai/*` forwards `openai/<name>` as `<name>`, so the models it serves are its upstream's own
(`GET <base_url>/models`), listed under the route's prefix, as LiteLLM lists wildcard routes. Each deployment's
upstream is asked at most once per `ttl_s` (after a failure, once per `failure_ttl_s`), never by two listings at
once; an ask is bounded in time (`timeout_s`, which also bounds how long a listing waits) and in size (`max_ids`
ids). An upstream that fails, hangs or answers nonsense leaves its models out of the listing; it never fails it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gateway.errors import GatewayError
from gateway.router import Deployment, ModelRoute, Router
from gateway.routing_config import DeploymentConfig

__all__ = ["ListsModels", "WildcardModels"]

logger = logging.getLogger("unigate.models")

DEFAULT_TTL_S = 300.0
DEFAULT_FAILURE_TTL_S = 30.0
DEFAULT_MAX_IDS = 1000


@runtime_checkable
class ListsModels(Protocol):
    """Optional capability of a backend: its upstream's model ids (`type: openai`: `GET /models`)."""

    async def list_models(self, *, max_ids: int) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class _Listing:
    upstream_ids: tuple[str, ...]
    expires_at: float


class WildcardModels:
    def __init__(
        self,
        *,
        timeout_s: float,
        ttl_s: float = DEFAULT_TTL_S,
        failure_ttl_s: float = DEFAULT_FAILURE_TTL_S,
        max_ids: int = DEFAULT_MAX_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.failure_ttl_s = failure_ttl_s
        self.max_ids = max_ids
        self._clock = clock
        self._listings: dict[str, _Listing] = {}  # deployment name -> its upstream's last listing
        self._asks: dict[str, asyncio.Task[None]] = {}  # deployment name -> the ask in flight

    async def public_ids(self, router: Router) -> list[str]:
        """The public ids the wildcard routes serve now (route prefix + upstream id), in routing-file order, without
        duplicates, and only those the router sends to the route that listed them (a more specific route or an
        explicit model id wins, as for a request)."""
        routes = [route for route in router.routes if route.config.is_wildcard]
        now = self._clock()
        asks = [
            self._ask(deployment)
            for route in routes
            for deployment in route.deployments
            if _lists_models(deployment) and not self._is_fresh(deployment.name, now)
        ]
        if asks:
            await asyncio.wait(asks, timeout=self.timeout_s)  # an ask still running is left out this time
        ids: dict[str, None] = {}
        for route in routes:
            for model_id in self._route_ids(route):
                target = router.find(model_id)
                if target is not None and target.route is route:
                    ids[model_id] = None
        return list(ids)

    def _is_fresh(self, name: str, now: float) -> bool:
        listing = self._listings.get(name)
        return listing is not None and listing.expires_at > now

    def _ask(self, deployment: Deployment) -> asyncio.Task[None]:
        task = self._asks.get(deployment.name)
        if task is None:
            task = asyncio.create_task(self._fetch(deployment), name=f"unigate-list-models-{deployment.name}")
            self._asks[deployment.name] = task
        return task

    async def _fetch(self, deployment: Deployment) -> None:
        backend = deployment.backend
        assert isinstance(backend, ListsModels)
        try:
            async with asyncio.timeout(self.timeout_s):
                upstream_ids = await backend.list_models(max_ids=self.max_ids)
            listing = _Listing(tuple(upstream_ids), self._clock() + self.ttl_s)
        except Exception as exc:  # whatever went wrong, the listing goes on without these models
            # A gateway error's code says what failed without the upstream's host; anything else only its type.
            reason = exc.code if isinstance(exc, GatewayError) else type(exc).__name__
            logger.warning(
                "GET /v1/models leaves out the models of wildcard deployment %s for %g s: listing them failed (%s)",
                deployment.name,
                self.failure_ttl_s,
                "timeout" if isinstance(exc, TimeoutError) else reason,
            )
            listing = _Listing((), self._clock() + self.failure_ttl_s)
        finally:
            self._asks.pop(deployment.name, None)
        self._listings[deployment.name] = listing

    def _route_ids(self, route: ModelRoute) -> list[str]:
        prefix = route.id[:-1]
        ids: list[str] = []
        for deployment in route.deployments:
            listing = self._listings.get(deployment.name)
            if listing is None:
                continue
            for upstream_id in listing.upstream_ids:
                suffix = _requested_suffix(deployment.config, upstream_id)
                if suffix:
                    ids.append(prefix + suffix)
        return ids


def _lists_models(deployment: Deployment) -> bool:
    """Whether the deployment's upstream list tells what it serves: it can list, and it maps each requested name to
    an upstream name (no `model`, or one with a `*`), rather than every request to one model."""
    model = deployment.config.model
    return isinstance(deployment.backend, ListsModels) and (model is None or "*" in model)


def _requested_suffix(config: DeploymentConfig, upstream_id: str) -> str | None:
    """What a client puts after the route's prefix to reach `upstream_id` (`DeploymentConfig.upstream_model`
    backwards); None when no request reaches it. A deployment whose `model` has no `*` sends every request to that
    one model (`_lists_models`): its upstream's list says nothing about the route."""
    if config.model is None:
        return upstream_id
    head, _, tail = config.model.partition("*")
    if len(upstream_id) <= len(head) + len(tail) or not upstream_id.startswith(head) or not upstream_id.endswith(tail):
        return None
    return upstream_id[len(head) : len(upstream_id) - len(tail)]
