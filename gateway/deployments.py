"""`build_backend`: one backend per routing-file deployment, configured from the deployment and the settings.

This is where the gateway's configuration becomes the backends' own (`backends.config.UpstreamConfig`, and
`backends.local.LocalBackendConfig` / `backends.engine_client.EngineClientConfig`, which take a local model's merged
options whole): backends never read the routing file or `Settings`. The local backend is imported only for
`type: local`, so a gateway that routes only to upstreams never imports torch; neither does a worker of
`unigate serve --workers N`, whose local deployments are clients of the host's engine process
(`backends.engine_client.EngineClient`, the sockets in `Settings.engine_sockets`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.anthropic import AnthropicBackend
from backends.base import Backend
from backends.config import LocalEngineOptions, LocalModelOptions, UpstreamConfig
from backends.openai import OpenAIBackend
from gateway.routing_config import DeploymentConfig, RoutingConfigError
from gateway.settings import EngineSettings, Settings

if TYPE_CHECKING:
    from backends.engine_client import EngineClientConfig
    from backends.local import LocalBackendConfig

__all__ = ["build_backend", "engine_client_config", "local_config", "local_model_settings", "upstream_config"]


def build_backend(deployment: DeploymentConfig, settings: Settings) -> Backend:
    """The backend for one deployment entry; `RoutingConfigError` when its type is not installed."""
    if deployment.type == "openai":
        return OpenAIBackend.from_config(upstream_config(deployment, settings))
    if deployment.type == "anthropic":
        return AnthropicBackend.from_config(upstream_config(deployment, settings))
    if deployment.name in settings.engine_sockets:  # `unigate serve --workers N`: the host's engine process
        from backends.engine_client import EngineClient

        return EngineClient(engine_client_config(deployment, settings))
    try:
        from backends.local import LocalBackend
    except ImportError as exc:
        raise RoutingConfigError(
            f"deployment {deployment.name!r}: `type: {deployment.type}` is not available in this installation "
            f"({exc}). Use `type: openai`, or install the missing part (for `local`: pip install 'unigate[engine]')."
        ) from None
    return LocalBackend.from_local_config(local_config(deployment, settings))


def local_model_settings(deployment: DeploymentConfig, settings: Settings) -> EngineSettings:
    """The engine settings as one `type: local` deployment sees them: each `LocalModelSettings` field its routing
    entry sets replaces the engine setting's (whole: a `speculative` or `sampling_defaults` entry is not merged
    field by field), the rest are the settings'. The one place the two meet, for the in-process backend and the
    engine process (`--workers N`) alike."""
    return settings.engine.model_copy(update=deployment.local_overrides())


def local_config(deployment: DeploymentConfig, settings: Settings) -> LocalBackendConfig:
    """A `type: local` deployment's config: `local_model_settings` as the local backend takes it, whole."""
    from backends.local import LocalBackendConfig

    engine = local_model_settings(deployment, settings)
    return LocalBackendConfig(
        name=deployment.name,
        model_id=deployment.id or engine.model_id,
        cache_dir=settings.data_dir / "models",
        engine=LocalEngineOptions.of(engine),
        clamp_max_tokens=True if deployment.clamp_max_tokens is None else deployment.clamp_max_tokens,
    )


def engine_client_config(deployment: DeploymentConfig, settings: Settings) -> EngineClientConfig:
    """A `type: local` deployment served by the engine process at its socket (`settings.engine_sockets`), with the
    model options that process applies (`local_model_settings`, as `local_config` gives them)."""
    from backends.engine_client import EngineClientConfig

    return EngineClientConfig(
        name=deployment.name,
        socket_path=settings.engine_sockets[deployment.name],
        model=LocalModelOptions.of(local_model_settings(deployment, settings)),
        clamp_max_tokens=True if deployment.clamp_max_tokens is None else deployment.clamp_max_tokens,
        connect_timeout_s=deployment.connect_timeout_s or settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_connections=deployment.max_connections,
    )


def upstream_config(deployment: DeploymentConfig, settings: Settings) -> UpstreamConfig:
    """An upstream deployment's config: its own timeouts where it sets them, the gateway's otherwise."""
    assert deployment.base_url is not None  # the routing file's validation requires it for upstream types
    return UpstreamConfig(
        deployment.name,
        base_url=deployment.base_url,
        api_key=deployment.api_key,
        timeout_s=deployment.timeout_s or settings.request_timeout_s,
        connect_timeout_s=deployment.connect_timeout_s or settings.connect_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_connections=deployment.max_connections,
        native_responses=deployment.native_responses,
        max_response_bytes=settings.max_upstream_response_bytes,
        max_event_bytes=settings.max_sse_event_bytes,
        first_event_timeout_s=settings.stream_first_token_timeout_s,
        idle_timeout_s=settings.stream_idle_timeout_s,
    )
