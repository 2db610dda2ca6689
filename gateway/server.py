"""`run(settings)`: serve the gateway with uvicorn (uvloop + httptools when installed), one or more workers.

Shutdown on SIGTERM / SIGINT, in order:
  1. uvicorn stops accepting connections and closes idle keep-alive ones;
  2. in-flight requests and streams may finish for `settings.shutdown_grace_s`;
  3. at the deadline the remaining request tasks are cancelled: a stream cut this way ends with an SSE error
     event (`server_shutting_down`) and `data: [DONE]`, never silently (`gateway.sse.EventStreamResponse`);
  4. the lifespan closes upstream pools / engines and access control (Redis);
  5. with several workers, once they have exited, the parent stops the engine processes they shared (one per
     local deployment, `gateway.engine_host`), then the embedded Redis it started.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.types import ASGIApp

from auth.embedded_redis import DataDirInUseError
from gateway.app import create_app, load_routing_for
from gateway.client_address import ForwardedClientMiddleware, forwarded_allow_ips
from gateway.http_limits import protocol_options
from gateway.logging import configure_logging
from gateway.routing_config import RoutingConfigError
from gateway.settings import InvalidSettingsError, Settings, load_settings

if TYPE_CHECKING:
    from gateway.engine_host.process import EngineSupervisor

__all__ = ["MIN_MASTER_KEY_CHARS", "app_from_env", "build_app", "check_master_key", "run", "uvicorn_config"]

logger = logging.getLogger("unigate.server")

MIN_MASTER_KEY_CHARS = 32  # a generated key has 49

# The parent process hands its fully resolved settings (CLI flags included) to worker processes here, and the
# sockets of the engine processes serving their local deployments (`Settings.engine_sockets`).
_SETTINGS_ENV = "UNIGATE__RESOLVED_SETTINGS"
_ENGINE_SOCKETS_ENV = "UNIGATE__ENGINE_SOCKETS"

# A young-generation collection runs once this many more container objects were allocated than freed, and walks every
# young one still alive. Each request in flight holds ~280 (c=128: ~36,000), so at 20,000 the collector ran ~1.5
# times a second at c=128 and 8 times at c=512, walking every request in flight each time: at c=512 a quarter of the
# gateway's CPU, so an overloaded gateway served fewer requests the more it was sent. At 100,000 it ran once in 45 s
# at c=128 and once in 6 s at c=512 (72-98 ms, shorter than the older generation's 114-132 ms it replaced there);
# at c=512 32% less CPU per request and 1.67x the requests/s (benchmarks/gateway_tail.py; benchmarks/RESULTS.md,
# 2026-12-06: the overload tail).
_GC_YOUNG_THRESHOLD = 100_000


def build_app(settings: Settings) -> Starlette:
    """The production app one worker serves: Redis-backed keys and limits (the configured Redis, or the embedded
    redis-server under the data directory), the master key (generated on first start when not configured) and
    the admin API."""
    from auth.access import AccessConfig, RedisAccess
    from auth.embedded_redis import RedisConnection
    from auth.master_key import resolve_master_key
    from auth.request_log import RequestLog
    from auth.store import KeyStore
    from gateway.routes.admin import admin_routes
    from gateway.routes.requests import request_log_routes

    connection = RedisConnection(settings.redis_url, settings.data_dir, timeout_s=settings.limits.redis_timeout_s)
    redis = connection.start()
    master_key = resolve_master_key(_configured_master_key(settings), settings.data_dir)
    config = AccessConfig(
        failure_mode=settings.redis_failure_mode,
        key_cache_ttl_s=settings.limits.key_cache_ttl_s,
        lease_ttl_s=settings.limits.lease_ttl_s,
    )
    access = RedisAccess(redis, config=config, master_key=master_key)
    log_settings = settings.request_log
    request_log = (
        RequestLog(
            redis,
            writer=access.command_pipe,
            retention_days=log_settings.retention_days,
            max_len=log_settings.max_records,
        )
        if log_settings.enabled
        else None
    )
    app = create_app(
        settings,
        access=access,
        upstream_limiter=access.upstream_limiter,
        extra_routes=[*admin_routes(), *request_log_routes()],
        on_shutdown=[connection.stop],
        request_log=request_log,
    )
    app.state.key_store = KeyStore(redis)
    app.state.master_key = master_key
    return app


def check_master_key(settings: Settings) -> None:
    """Refuse a configured master key shorter than `MIN_MASTER_KEY_CHARS` (it alone opens the admin API), unless
    `UNIGATE_ALLOW_WEAK_MASTER_KEY=true`, which only logs a warning."""
    key = _configured_master_key(settings)
    if key is None or len(key) >= MIN_MASTER_KEY_CHARS:
        return
    if not settings.allow_weak_master_key:
        raise SystemExit(
            f"unigate: UNIGATE_MASTER_KEY is shorter than {MIN_MASTER_KEY_CHARS} characters ({len(key)}): use a "
            "long random key (e.g. sk-ug-$(openssl rand -hex 24)), or unset it to have one generated in the data "
            "directory. To start with it anyway (tests, never production), set UNIGATE_ALLOW_WEAK_MASTER_KEY=true."
        )
    logger.warning(
        "UNIGATE_MASTER_KEY is shorter than %d characters (%d) and UNIGATE_ALLOW_WEAK_MASTER_KEY=true lets it "
        "through: whoever guesses it controls every key and limit. Never run a production gateway like this.",
        MIN_MASTER_KEY_CHARS,
        len(key),
    )


def app_from_env() -> ASGIApp:
    """uvicorn factory used in every worker: rebuilds the parent's settings and the app, behind the handling of
    `X-Forwarded-For` that keeps the peer (`gateway.client_address`; uvicorn's own is off)."""
    raw = os.environ.get(_SETTINGS_ENV)
    try:
        settings = load_settings(**orjson.loads(raw)) if raw else load_settings()
    except InvalidSettingsError as exc:  # started as a bare uvicorn factory, without `unigate serve`
        raise SystemExit(f"unigate: {exc}") from None
    sockets = os.environ.get(_ENGINE_SOCKETS_ENV)
    if sockets:
        settings = settings.with_engine_sockets(orjson.loads(sockets))
    configure_logging(settings.log_level, settings.log_format)
    if not raw:  # `unigate serve` checked it before starting this worker
        check_master_key(settings)
    if settings.workers > 1:
        # A worker of `unigate serve --workers N` must not outlive a killed parent: the parent restarts the engine,
        # and a worker serving on without one would answer 503 forever while holding the port.
        from gateway.engine_host.process import exit_with_parent

        exit_with_parent(os.getppid())
    try:
        app = build_app(settings)
    except DataDirInUseError as exc:
        raise SystemExit(f"unigate: {exc}") from None
    # The objects built so far live as long as the worker: move them out of the collector's sight, and collect
    # less often (profiled: ~10% of the hot path's CPU went to the cyclic GC; with this, ~25% less CPU/request).
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 20)
    return ForwardedClientMiddleware(app, forwarded_allow_ips())


def uvicorn_config(settings: Settings) -> uvicorn.Config:
    """uvloop when installed; httptools (else h11) with limits on the request head (`gateway.http_limits`)."""
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    return uvicorn.Config(
        "gateway.server:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        loop="uvloop" if has_uvloop else "asyncio",
        **protocol_options(settings.max_header_bytes),
        lifespan="on",
        proxy_headers=False,  # handled in the app (`app_from_env`), which keeps the proxy's own address
        log_config=None,  # configure_logging owns the handlers
        access_log=False,  # the metrics middleware logs one structured line per request
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),
        timeout_keep_alive=30,
    )


def run(settings: Settings) -> None:
    from auth.embedded_redis import EmbeddedRedis
    from auth.master_key import resolve_master_key

    configure_logging(settings.log_level, settings.log_format)
    check_master_key(settings)  # before anything is started or written
    if settings.redis_url is None:  # refused now if another process runs on this data directory, before writing
        try:
            EmbeddedRedis(settings.data_dir).check_available()
        except DataDirInUseError as exc:
            raise SystemExit(f"unigate: {exc}") from None
    # Resolve once in the parent so a generated master key is created and printed exactly once.
    if settings.master_key is None:
        key = resolve_master_key(_configured_master_key(settings), settings.data_dir)
        settings = settings.model_copy(update={"master_key": SecretStr(key)})
    # Fail on a bad routing file here, with its message, before any worker starts.
    try:
        create_app(settings)
    except RoutingConfigError as exc:
        raise SystemExit(f"unigate: {exc}") from None
    embedded: EmbeddedRedis | None = None
    if settings.workers > 1 and settings.redis_url is None:
        # Several workers share one embedded server, owned (started and stopped) by this parent process.
        embedded = EmbeddedRedis(settings.data_dir)
        try:
            settings = settings.model_copy(update={"redis_url": embedded.start()})
        except DataDirInUseError as exc:
            raise SystemExit(f"unigate: {exc}") from None
    os.environ[_SETTINGS_ENV] = orjson.dumps(_resolved(settings)).decode()
    os.environ.pop(_ENGINE_SOCKETS_ENV, None)
    config = uvicorn_config(settings)
    engines: EngineSupervisor | None = None
    try:
        if settings.workers > 1:
            from uvicorn.supervisors import Multiprocess

            sock = config.bind_socket()
            engines = _start_engines(settings)
            Multiprocess(config, sockets=[sock]).run()
        else:
            uvicorn.Server(config).run()
    finally:
        if engines is not None:
            engines.stop()  # after the workers, which may have been streaming from them
        if embedded is not None:
            embedded.stop()


def _start_engines(settings: Settings) -> EngineSupervisor | None:
    """One engine process per local deployment, shared by the workers (`gateway.engine_host`); the workers
    learn their sockets from `_ENGINE_SOCKETS_ENV`."""
    from gateway.engine_host.process import EngineStartError, EngineSupervisor

    engines = EngineSupervisor.for_routing(load_routing_for(settings), settings.data_dir, os.environ[_SETTINGS_ENV])
    if engines is None:
        return None
    try:
        engines.start()
    except EngineStartError as exc:
        raise SystemExit(f"unigate: {exc}") from None
    os.environ[_ENGINE_SOCKETS_ENV] = orjson.dumps(engines.sockets).decode()
    return engines


def _resolved(settings: Settings) -> dict[str, Any]:
    data: dict[str, Any] = settings.model_dump(mode="json")
    # Secrets dump as "**********": hand the workers the real values.
    if settings.master_key is not None:
        data["master_key"] = settings.master_key.get_secret_value()
    if settings.metrics_token is not None:
        data["metrics_token"] = settings.metrics_token.get_secret_value()
    return data


def _configured_master_key(settings: Settings) -> str | None:
    return settings.master_key.get_secret_value() if settings.master_key is not None else None
