"""Backends: the deployments the router sends requests to, built from the routing file by `build_backend`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from backends.base import Backend, Endpoint, Json

if TYPE_CHECKING:
    from gateway.routing_config import DeploymentConfig
    from gateway.settings import Settings

__all__ = ["Backend", "Endpoint", "Json", "build_backend"]

_LAZY = {"local": ("backends.local", "LocalBackend"), "anthropic": ("backends.anthropic", "AnthropicBackend")}


def build_backend(deployment: DeploymentConfig, settings: Settings) -> Backend:
    """One backend per deployment entry. `local` and `anthropic` modules are imported lazily so a gateway that
    routes only to OpenAI-compatible upstreams never imports torch."""
    from gateway.routing_config import RoutingConfigError

    if deployment.type == "openai":
        from backends.openai import OpenAIBackend

        return OpenAIBackend.from_config(deployment, settings)
    module, cls_name = _LAZY[deployment.type]
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as exc:
        raise RoutingConfigError(
            f"deployment {deployment.name!r}: `type: {deployment.type}` is not available in this installation "
            f"({exc}). Use `type: openai`, or install the missing part (for `local`: pip install 'unigate[engine]')."
        ) from None
    backend: Backend = cls.from_config(deployment, settings)
    return backend
