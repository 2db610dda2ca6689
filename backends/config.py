"""The backends' own configuration: `UpstreamConfig`, everything an upstream backend (`type: openai`,
`type: anthropic`) is built from, and the options of a local model (`LocalModelOptions`, `LocalEngineOptions`),
which the local backend (`backends.local.LocalBackendConfig`) and the engine client
(`backends.engine_client.EngineClientConfig`) take whole.

The composition root (`gateway.deployments`) fills them in from a routing-file deployment and the gateway's settings;
backends never read either. The defaults are the gateway's, for tests and scripts that build a backend by hand.
`LocalModelOptions` and `LocalEngineOptions` are where their fields are declared, once: the gateway's
`LocalModelSettings` (what a routing entry may set) and `EngineSettings` (`UNIGATE_ENGINE__<FIELD>`) extend them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from local_engine.config import EngineConfig, ModelOptions
from local_engine.sampling_params import sampling_defaults

__all__ = ["LocalEngineOptions", "LocalModelOptions", "UpstreamConfig"]


class LocalModelOptions(ModelOptions):
    """One local model's own options: its checkpoint, what a request that leaves them out gets (output limit,
    sampling), and, from the engine's `ModelOptions`, its weights' quantization and speculative decoding. A
    `type: local` deployment may set each for itself (`gateway.settings.LocalModelSettings`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str | None = None  # HF directory or GGUF file; None = the bundled SmolLM2-135M-Instruct
    # The output limit of a request that sets none (Codex CLI sends none), so a turn ends in bounded time.
    # 0 = none: generate until EOS or the context is full.
    default_max_tokens: int = Field(default=1024, ge=0)
    # Sampling for a request that leaves these fields out (temperature, top_p, top_k, min_p, repetition_penalty),
    # e.g. {"temperature": 0.7}, taken whole (a deployment's does not merge with the engine setting's). None = the
    # model's own (generation_config.json, `loader.model_sampling_defaults`; the bundled model: temperature 0.2);
    # {} = OpenAI's defaults.
    sampling_defaults: dict[str, Any] | None = None  # checked strictly by `_check_sampling_defaults`

    @field_validator("sampling_defaults")
    @classmethod
    def _check_sampling_defaults(cls, value: dict[str, Any] | None) -> dict[str, float] | None:
        return None if value is None else sampling_defaults(value)


class LocalEngineOptions(EngineConfig, LocalModelOptions):
    """What the local backend serves its model with: the engine's run options (`EngineConfig`), the model's own
    (`LocalModelOptions`), and how long a request waits for the model to load. The gateway's `EngineSettings`
    extends this model (`UNIGATE_ENGINE__<FIELD>`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # While the model loads, a request waits this long for it, then gets 503 engine_loading with Retry-After.
    load_wait_s: float = Field(default=30.0, ge=0)


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """One upstream deployment. `name` is its stable id (metrics, cooldowns, messages), never a hostname;
    `base_url` includes the API's version prefix (`https://api.example.com/v1`)."""

    name: str
    base_url: str
    api_key: str | None = None
    # A non-streaming call's whole exchange, and a stream's response headers, must come within `timeout_s`.
    timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # one socket read (capped by `timeout_s`)
    max_connections: int = 100  # the pool's size
    keepalive_s: float = 30.0  # how long an idle pooled connection is kept
    native_responses: bool = False  # `type: openai`: the upstream serves /v1/responses itself
    # Hardening against a hostile or broken upstream (docs/upstreams.md): decompressed sizes, and stream deadlines
    # counted in events (comments and pings do not count).
    max_response_bytes: int = 64 * 1024 * 1024  # one non-streaming body
    max_event_bytes: int = 8 * 1024 * 1024  # one SSE event (or unfinished line)
    first_event_timeout_s: float = 600.0  # request sent → first stream event
    idle_timeout_s: float = 300.0  # between two stream events
