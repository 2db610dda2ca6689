"""The backend protocol: what the router needs from an upstream API or the local engine.

Bodies are plain dicts already parsed by the route (the route rewrites `model` to the deployment's name and
adds what the backend needs, e.g. `stream_options.include_usage`). Backends raise `gateway.errors` types
(`BackendError` and subclasses, `EngineError`); they never return error payloads as data.

Optional capabilities are declared here as runtime-checkable protocols (`ReportsHealthState`, `CountsPromptTokens`,
`FitsOutput`, `ReportsEngineStats`; of a stream: `ReportsStreamUsage`, `ReportsEngineStages`), and the gateway asks
for them with `isinstance`, never with `getattr`. Such a check costs microseconds: on a per-request path, remember its
answer per backend class (`gateway.output_limits` does).

Each call says whose it is (`Tenancy`: the caller's tenant, weight and priority class): the local engine shares
itself between tenants by it (local_engine/fair_share.py); upstream backends ignore it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from local_engine.fair_share import Priority, Tenancy

__all__ = [
    "ENGINE_STAGES_KEY",
    "FORWARDED_HEADERS",
    "MAX_TOKENS_CLAMPED_KEY",
    "Backend",
    "CountsPromptTokens",
    "Endpoint",
    "EngineStageTimes",
    "FitsOutput",
    "HealthState",
    "Json",
    "MeteredStream",
    "OutputLimits",
    "Priority",
    "ReportsEngineStages",
    "ReportsEngineStats",
    "ReportsHealthState",
    "ReportsStreamUsage",
    "Tenancy",
]

Json = dict[str, Any]

# Client request headers the gateway hands to backends. Anthropic's beta flags change what a Messages body may hold
# (Claude Code sends them on every request); upstream credentials and everything else are the deployment's own.
FORWARDED_HEADERS = ("anthropic-beta",)

# The API surface a call targets, as a path under the upstream's /v1.
Endpoint = Literal["chat/completions", "completions", "embeddings", "responses", "messages", "messages/count_tokens"]

# A deployment's own view of its health; `/health/ready` adds `cooling_down` (the router's view).
HealthState = Literal["up", "down", "loading", "restarting"]

# A backend that lowered a request's output limit to fit its context says so in its response (or its stream's first
# chunk) under this key, as `[requested, served]`; the gateway removes the key and answers with the header
# `x-unigate-max-tokens-clamped: <requested> -> <served>`. (Over HTTP, `unigate engine serve` sends that header.)
MAX_TOKENS_CLAMPED_KEY = "x_unigate_max_tokens_clamped"

# The local engine's unstreamed answer says under this key when its request reached each stage in the engine,
# `[queued, scheduled, first token, finished]` (wall clock ns, 0 for a stage not reached:
# `local_engine.output_processor.EngineStages`); the gateway removes the key and traces the stages. A stream says it
# through `ReportsEngineStages`.
ENGINE_STAGES_KEY = "x_unigate_engine_stages"

# (queued, scheduled, first token, finished): see ENGINE_STAGES_KEY
EngineStageTimes = tuple[int, int, int, int]


@runtime_checkable
class Backend(Protocol):
    """One deployment: an OpenAI-compatible upstream, an Anthropic upstream, or the local engine."""

    name: str  # stable deployment id, used in metrics, cooldowns and Redis lease keys (never a hostname)

    def supports(self, endpoint: Endpoint) -> bool:
        """Whether this backend serves `endpoint` natively (the gateway translates otherwise)."""
        ...

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> Json:
        """One non-streaming call; returns the parsed JSON response of that endpoint's family. `headers`: the
        client's headers a backend may pass on (`FORWARDED_HEADERS`; only an Anthropic upstream uses them).
        `tenancy`: whose call it is (None: nobody's in particular); only the local engine uses it."""
        ...

    def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> AsyncIterator[Json]:
        """A streaming call yielding each parsed event/chunk (OpenAI chunks, or Anthropic events with their
        `type`); the iterator ends after the final chunk (the `[DONE]` marker is not yielded). Closing the
        iterator early (client gone) must cancel the upstream request promptly. A stream that knows its usage
        when it is closed early says so (`ReportsStreamUsage`)."""
        ...

    async def check_health(self) -> bool:
        """A cheap reachability probe for /health/ready."""
        ...

    async def aclose(self) -> None:
        """Release pools and background resources."""
        ...


@runtime_checkable
class ReportsHealthState(Protocol):
    """Optional capability: a backend that knows its own state without a network probe (the local engine). The
    gateway's health prober reports this state and never takes such a deployment out of rotation: its requests
    get its own, more precise answer (503 `engine_loading` while loading, `engine_error` when it failed)."""

    def health_state(self) -> HealthState: ...


@runtime_checkable
class CountsPromptTokens(Protocol):
    """Optional capability: a backend that counts a chat-completions prompt exactly as its `usage.prompt_tokens`
    would (the local engine: its tokenizer and chat template). `POST /v1/messages/count_tokens` answers with this
    count; for other backends the gateway can only estimate."""

    async def count_prompt_tokens(self, body: Json) -> int: ...


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """How a deployment limits a request's output: its context length in tokens (None while unknown), whether an
    output limit too big for that context is lowered to the room left (`is_clamping`) rather than refused, and the
    limit it applies when the request sets none (None: no default)."""

    context_length: int | None
    is_clamping: bool
    default_max_tokens: int | None


@runtime_checkable
class FitsOutput(Protocol):
    """Optional capability: a backend that fits each request's output limit to its own context exactly (the local
    engine counts the prompt with its tokenizer). The gateway reads the limits to reserve tokens at admission."""

    def output_limits(self) -> OutputLimits: ...


@runtime_checkable
class ReportsEngineStats(Protocol):
    """Optional capability: a backend that runs an engine in this process (the local engine) and reports its
    state for `/metrics` and `/v1/models`: at least `name` and `loaded`, and once loaded its throughput, memory,
    `dtype` and `max_model_len`. Called on demand; no I/O."""

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class ReportsStreamUsage(Protocol):
    """Optional capability of a stream (the iterator `Backend.stream` returns): the usage of what it computed so
    far, in the OpenAI `usage` shape, exact also once it was closed early (the local engine's own prompt, cached
    and generated counts); None while nothing is counted. The gateway charges it for a stream cut before its
    usage chunk, where it would otherwise charge an estimate."""

    def usage_so_far(self) -> Json | None: ...


@runtime_checkable
class ReportsEngineStages(Protocol):
    """Optional capability of a stream (the local engine's): when its request reached each stage in the engine so
    far, `(queued, scheduled, first token, finished)` (see `ENGINE_STAGES_KEY`; a stream closed early knows the
    stages it reached); None while the engine reported none. The gateway traces them."""

    def engine_stages(self) -> EngineStageTimes | None: ...


class MeteredStream:
    """A stream that reports its usage so far (`ReportsStreamUsage`) and its engine stages (`ReportsEngineStages`):
    the chunks of `chunks`, and whatever `meter()` and `stages()` say, which the generator keeps up to date as it
    makes them."""

    __slots__ = ("_chunks", "_meter", "_stages")

    def __init__(
        self,
        chunks: AsyncGenerator[Json, None],
        meter: Callable[[], Json | None],
        stages: Callable[[], EngineStageTimes | None] | None = None,
    ) -> None:
        self._chunks = chunks
        self._meter = meter
        self._stages = stages

    def __aiter__(self) -> MeteredStream:
        return self

    async def __anext__(self) -> Json:
        return await anext(self._chunks)

    async def aclose(self) -> None:
        await self._chunks.aclose()

    def usage_so_far(self) -> Json | None:
        return self._meter()

    def engine_stages(self) -> EngineStageTimes | None:
        return None if self._stages is None else self._stages()
