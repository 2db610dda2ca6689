"""`UpstreamConfig`: everything an upstream backend (`type: openai`, `type: anthropic`) is built from.

The composition root (`gateway.deployments`) fills one in from a routing-file deployment and the gateway's settings;
backends never read either. The defaults are the gateway's, for tests and scripts that build a backend by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UpstreamConfig"]


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
