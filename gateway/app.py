"""`create_app(settings)`: the Starlette application, its routes, middleware stack and lifespan.

`app.state` holds `settings`, `access` (an `AccessControl`), `upstream_limiter` (an `UpstreamLimiter`), `routing`
(the parsed routing file), `metrics`, `started_at`, and — once the lifespan has started — `router` and
`health_prober` (deployment health probes on the gateway's own schedule; `/health/ready` reads them) and
`replica_metrics` (the replicas' own load, polled for `routing: least_load` / `prefix_affinity`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute

from auth.access import RedisAccess
from auth.base import AccessControl, MasterKeyAccess, NoUpstreamLimit, UpstreamLimiter
from auth.request_log import RequestLog
from backends.base import Backend
from gateway.access_metrics import AccessStatsCollector
from gateway.deployments import build_backend
from gateway.engine_metrics import EngineStatsCollector
from gateway.metrics import GatewayMetrics
from gateway.middleware import build_middleware, http_exception_handler
from gateway.replica_metrics import ReplicaMetricsPoller
from gateway.router import Router
from gateway.router_tasks import RouterTasks
from gateway.routes import anthropic, health_routes, openai_routes, responses
from gateway.routes.ui import console_routes
from gateway.routing_config import RoutingConfig, default_routing, load_routing
from gateway.settings import Settings
from gateway.tracing import Tracing, tracing_from_env

__all__ = ["create_app", "load_routing_for"]

logger = logging.getLogger("unigate.app")


def load_routing_for(settings: Settings) -> RoutingConfig:
    """The routing file in use (`RoutingConfigError` if invalid), else the default table."""
    path = settings.routing_file()
    return load_routing(path) if path is not None else default_routing(settings)


def create_app(
    settings: Settings,
    *,
    access: AccessControl | None = None,
    upstream_limiter: UpstreamLimiter | None = None,
    backends: Mapping[str, Backend] | None = None,
    routing: RoutingConfig | None = None,
    extra_routes: Sequence[BaseRoute] = (),
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    request_log: RequestLog | None = None,
    tracing: Tracing | None = None,
) -> Starlette:
    """Build the gateway. The routing file is validated here, so a bad one fails before the server starts.

    `backends` maps deployment names to ready backends (used instead of building them; the caller owns and
    closes those). `extra_routes` mounts further routes (admin). The lifespan starts `access` (when it has an async
    `start()`), builds the remaining backends and the router, and on shutdown closes backends, then `access`, then
    runs `on_shutdown` (e.g. stopping an embedded Redis). `request_log` (auth/request_log.py) gets one record per
    model request, written in the background; `tracing` defaults to what the `OTEL_*` variables ask for
    (gateway/tracing.py: off unless an OTLP endpoint is set). `upstream_limiter` caps each deployment's requests in
    flight (`max_in_flight`); by default that of a `RedisAccess` (closed with it), else none.
    """
    routing = routing if routing is not None else load_routing_for(settings)
    access = access if access is not None else _default_access(settings)
    upstream_limiter = upstream_limiter if upstream_limiter is not None else _default_upstream_limiter(access)
    provided = dict(backends or {})
    tracing = tracing if tracing is not None else tracing_from_env()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        built: dict[str, Backend] = {}
        tasks: RouterTasks | None = None
        app.state.replica_metrics = poller = ReplicaMetricsPoller()
        start = getattr(access, "start", None)
        if start is not None:
            await start()
        if request_log is not None:
            request_log.start()
        try:
            for model in routing.models:
                for deployment in model.deployments:
                    if deployment.name not in provided:
                        built[deployment.name] = build_backend(deployment, settings)
            app.state.router = engine_collector.router = Router(routing, {**built, **provided})
            metrics.watch_slo(app.state.router.routes)
            tasks = RouterTasks(app.state.router, settings, access, poller)
            app.state.health_prober = tasks.prober
            tasks.start()
            yield
        finally:
            # Shutdown (after the server stopped accepting and in-flight requests finished or were cut):
            # 0. stop the router's background work (gateway/router_tasks.py); 1. close the upstream pools and
            # engines we built;
            if tasks is not None:
                await tasks.stop()
            else:
                await poller.stop()
            for name, backend in built.items():
                try:
                    await backend.aclose()
                except Exception:
                    logger.exception("closing backend %s failed", name)
            # 2. write the request log's last records and export the last spans; 3. close access control.
            if request_log is not None:
                await request_log.aclose()
            if tracing is not None:
                tracing.shutdown()
            await access.aclose()
            # 4. stop what the caller asked us to (the embedded Redis goes last: access may still flush to it).
            for hook in on_shutdown:
                await hook()

    metrics = GatewayMetrics(model_ids=[model.id for model in routing.models])
    console = console_routes() if settings.console.enabled else []  # logs in only where the admin API is served
    engine_collector = EngineStatsCollector()
    metrics.registry.register(engine_collector)
    metrics.registry.register(AccessStatsCollector(access))
    app = Starlette(
        routes=[*openai_routes(), *anthropic.routes(), *responses.routes(), *health_routes(), *extra_routes, *console],
        middleware=build_middleware(settings, metrics, request_log=request_log, tracing=tracing),
        exception_handlers={HTTPException: http_exception_handler},
        lifespan=lifespan,
    )
    # No slash redirect: it would point at whatever Host the client sent (middleware/path_normalize.py).
    app.router.redirect_slashes = False
    app.state.settings = settings
    app.state.access = access
    app.state.upstream_limiter = upstream_limiter
    app.state.routing = routing
    app.state.metrics = metrics
    app.state.started_at = time.time()
    app.state.request_log = request_log
    return app


def _default_access(settings: Settings) -> AccessControl:
    if settings.master_key is not None:
        return MasterKeyAccess(settings.master_key.get_secret_value())
    logger.warning("UNIGATE_MASTER_KEY is not set and no access control was given: no client key will be accepted")
    return MasterKeyAccess(secrets.token_urlsafe(32))


def _default_upstream_limiter(access: AccessControl) -> UpstreamLimiter:
    """The Redis-backed access control's limiter (same connection, failure handling and counters); with any other
    access control, no cap (`max_in_flight` is enforced through Redis)."""
    return access.upstream_limiter if isinstance(access, RedisAccess) else NoUpstreamLimit()
