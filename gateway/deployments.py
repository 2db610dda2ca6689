"""`build_backend`: one backend per routing-file deployment, configured from the deployment and the settings.

This is where the gateway's configuration becomes the backends' own (`backends.config.UpstreamConfig`,
`backends.local.LocalBackendConfig`): backends never read the routing file or `Settings`. The local backend is
imported only for `type: local`, so a gateway that routes only to upstreams never imports torch; neither does a
worker of `unigate serve --workers N`, whose local deployments are clients of the host's engine process
(`backends.engine_client.EngineClient`, the sockets in `Settings.engine_sockets`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.anthropic import AnthropicBackend
from backends.base import Backend
from backends.config import UpstreamConfig
from backends.openai import OpenAIBackend
from gateway.routing_config import DeploymentConfig, RoutingConfigError
from gateway.settings import Settings

if TYPE_CHECKING:
    from backends.engine_client import EngineClientConfig
    from backends.local import LocalBackendConfig

__all__ = ["build_backend", "engine_client_config", "local_config", "upstream_config"]


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


def local_config(deployment: DeploymentConfig, settings: Settings) -> LocalBackendConfig:
    """A `type: local` deployment's config: its own model, output limits, sampling defaults, speculative decoding
    and quantization where it sets them, the engine settings' otherwise."""
    from backends.local import LocalBackendConfig

    engine = settings.engine
    engine_config = engine.engine_config()
    if deployment.speculative is not None:
        engine_config = engine_config.model_copy(update={"speculative": deployment.speculative})
    quantization = {
        field: getattr(deployment, field)
        for field in ("quantization", "quantization_group_size")
        if getattr(deployment, field) is not None
    }
    if quantization:
        engine_config = engine_config.model_copy(update=quantization)
    return LocalBackendConfig(
        name=deployment.name,
        model_id=deployment.id or engine.model_id,
        cache_dir=settings.data_dir / "models",
        model_path=deployment.model_path or engine.model_path,
        engine=engine_config,
        load_wait_s=engine.load_wait_s,
        clamp_max_tokens=True if deployment.clamp_max_tokens is None else deployment.clamp_max_tokens,
        default_max_tokens=(
            engine.default_max_tokens if deployment.default_max_tokens is None else deployment.default_max_tokens
        ),
        sampling_defaults=(
            engine.sampling_defaults if deployment.sampling_defaults is None else deployment.sampling_defaults
        ),
    )


def engine_client_config(deployment: DeploymentConfig, settings: Settings) -> EngineClientConfig:
    """A `type: local` deployment served by the engine process at its socket (`settings.engine_sockets`), with the
    output limits that process applies (as `local_config` gives them)."""
    from backends.engine_client import EngineClientConfig

    return EngineClientConfig(
        name=deployment.name,
        socket_path=settings.engine_sockets[deployment.name],
        clamp_max_tokens=True if deployment.clamp_max_tokens is None else deployment.clamp_max_tokens,
        default_max_tokens=(
            settings.engine.default_max_tokens
            if deployment.default_max_tokens is None
            else deployment.default_max_tokens
        ),
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
