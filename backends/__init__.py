"""Backends: the deployments the router sends requests to (an OpenAI-compatible upstream, an Anthropic upstream,
the local engine), each behind the `Backend` protocol with its optional capabilities.

The gateway builds them from the routing file (`gateway.deployments.build_backend`); the upstream ones take a
`backends.config.UpstreamConfig`.
"""

from __future__ import annotations

from backends.base import (
    MAX_TOKENS_CLAMPED_KEY,
    Backend,
    CountsPromptTokens,
    Endpoint,
    FitsOutput,
    HealthState,
    Json,
    OutputLimits,
    ReportsEngineStats,
    ReportsHealthState,
)

__all__ = [
    "MAX_TOKENS_CLAMPED_KEY",
    "Backend",
    "CountsPromptTokens",
    "Endpoint",
    "FitsOutput",
    "HealthState",
    "Json",
    "OutputLimits",
    "ReportsEngineStats",
    "ReportsHealthState",
]
