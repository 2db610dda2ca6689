"""The routing file (YAML): which public model IDs exist and which deployments serve them.

```yaml
models:
  - id: gpt-4o-mini              # public model ID clients send
    aliases: [fast]
    deployments:
      - type: openai             # openai | anthropic | local
        base_url: https://api.example.com/v1
        api_key: env:UPSTREAM_KEY  # literal, or env:NAME so secrets stay out of the file
        model: gpt-4o-mini       # upstream's model name (default: the id)
        weight: 1
        timeout_s: 60
        max_connections: 100
        max_in_flight: 20        # optional cluster-wide cap (Redis leases)
        pool_timeout: 5          # seconds to wait for one of those slots before 503
        pricing: {input_per_mtok: 0.15, output_per_mtok: 0.60}   # optional, overrides the model's
        context_length: 128000   # optional: the upstream model's context; enables clamp_max_tokens (estimated)
        clamp_max_tokens: true   # an output limit too big for the context is lowered, not refused (default:
                                 # true for `type: local` and for upstreams with context_length)
        metrics_url: http://gpu-1:8000/metrics  # optional: the replica's Prometheus metrics (vLLM, SGLang, unigate
                                 # engine serve), polled for `routing: least_load` / `prefix_affinity`
        max_concurrency: 16      # optional, with `slo`: the live limit's start (else `slo_seed`'s, else 1)
    routing: least_in_flight     # least_in_flight (default) | round_robin | least_load | prefix_affinity
    affinity:                    # optional, for `routing: prefix_affinity`; these are the defaults
      block_chars: 256           # the request's leading text is hashed in blocks of this many characters
      max_blocks: 64             # at most this many leading blocks make the key
      load_factor: 1.5           # bounded load: no deployment takes more than this times the mean load
      load_slack: 0              # ... plus this many requests
      session_keys: true         # x-session-id, prompt_cache_key, user, metadata.user_id key the request when sent
    slo:                         # optional: SLO-aware admission (gateway/slo_admission.py); ttft_ms and/or tpot_ms
      ttft_ms: 500               # p95 time to first token each deployment must keep
      tpot_ms: 50                # p95 time per output token after the first
      max_queue: 64              # requests that may wait per deployment; more are shed at once (503 overloaded)
      max_wait_ms: 250           # a waiting request's deadline (default: half of ttft_ms, else 1000)
      max_limit: 256             # the live limit's ceiling per deployment
    slo_seed: runs/qwen.json     # optional: a `unigate bench --slo ... --out` file; its max concurrency meeting
                                 # the SLO starts every deployment's limit (relative: to this file's directory)
    pricing:                     # optional: price per million tokens, charged to keys' spend (budget_usd)
      input_per_mtok: 0.15
      output_per_mtok: 0.60
      currency: USD
  - id: local                    # the local engine (model_path: an HF directory or GGUF; default the bundled model)
    deployments:
      - type: local
        default_max_tokens: 1024 # output limit when the client sends none (default: the engine setting)
        quantization: int8       # optional: none | int8 | int4 weights, quantized at load (quantization_group_size)
  - id: openai/*                 # wildcard: forwards openai/<anything> as <anything>
    deployments: [{type: openai, base_url: ..., api_key: env:OPENAI_API_KEY}]
fallbacks:
  gpt-4o-mini: [other-model]
router:                          # optional; these are the defaults
  num_retries: 2
  retry_backoff_s: 0.05
  max_backoff_s: 2.0
  cooldown_s: 30                 # also the cooldown after a 429 without a usable Retry-After
  max_retry_after_s: 300         # a 429's Retry-After (seconds or HTTP-date) is honoured up to this
  max_fails: 3
  metrics_interval_s: 1.0        # how often replicas' `metrics_url` are polled
  metrics_timeout_s: 0.5         # a poll not answered within this counts as failed
  metrics_stale_s: 3.0           # older load figures are not used (the gateway's in-flight counts are)
```

Any problem is raised as `RoutingConfigError` whose message names the file, the field and the fix.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from gateway.settings import LocalModelSettings, Settings

__all__ = [
    "AffinityConfig",
    "DeploymentConfig",
    "ModelConfig",
    "PricingConfig",
    "RouterConfig",
    "RoutingConfig",
    "RoutingConfigError",
    "RoutingPolicy",
    "SloConfig",
    "default_routing",
    "load_routing",
    "parse_routing",
]

_ENV_PREFIX = "env:"

# How a model's deployments are picked (gateway/routing_policies.py); `least_in_flight` is the router's own default.
RoutingPolicy = Literal["least_in_flight", "round_robin", "least_load", "prefix_affinity"]


class RoutingConfigError(Exception):
    """The routing file cannot be used; raised at start-up with a message naming the file, field and fix."""


class PricingConfig(BaseModel):
    """Prices per million tokens. A request costs `prompt × input + completion × output` millionths of the
    currency unit, rounded to the nearest whole micro-unit (1e-6 USD) per request; spend is kept in integer
    micro-units so it never drifts."""

    model_config = ConfigDict(extra="forbid")

    input_per_mtok: Decimal = Field(default=Decimal(0), ge=0, le=1_000_000)
    output_per_mtok: Decimal = Field(default=Decimal(0), ge=0, le=1_000_000)
    currency: Literal["USD"] = "USD"

    @field_validator("input_per_mtok", "output_per_mtok")
    @classmethod
    def _check_precision(cls, value: Decimal) -> Decimal:
        if value != value.quantize(Decimal("0.000001")):
            raise ValueError("prices have at most 6 decimal places (one micro-unit per million tokens)")
        return value

    def cost_micros(self, prompt_tokens: int, completion_tokens: int) -> int:
        """Integer micro-units for one request (integer arithmetic only)."""
        scale = Decimal(1_000_000)
        input_price, output_price = int(self.input_per_mtok * scale), int(self.output_per_mtok * scale)
        exact = max(prompt_tokens, 0) * input_price + max(completion_tokens, 0) * output_price  # micro-micro-units
        return (exact + 500_000) // 1_000_000  # half up


class DeploymentConfig(LocalModelSettings):
    """One deployment entry. A `type: local` entry may set `LocalModelSettings`' fields (model_path,
    default_max_tokens, sampling_defaults, quantization, quantization_group_size, speculative): declared once in
    `backends.config.LocalModelOptions` (which `LocalModelSettings` extends), with the engine settings' defaults;
    those the entry sets (`local_overrides`) replace the engine settings' (`gateway.deployments.local_model_settings`),
    the others follow them. A null value counts as not set."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    type: Literal["openai", "anthropic", "local"]
    name: str = ""  # stable deployment id for metrics/cooldowns/leases; default "<model id>#<index>"
    id: str = ""  # the public model ID this deployment serves (filled in from the model entry)
    base_url: str | None = None
    api_key: str | None = None  # resolved: `env:NAME` is replaced by the variable's value at load time
    model: str | None = None  # upstream model name; default the public id (for wildcards: the matched suffix)
    weight: float = Field(default=1.0, gt=0)
    timeout_s: float | None = Field(default=None, gt=0)
    connect_timeout_s: float | None = Field(default=None, gt=0)
    max_connections: int = Field(default=100, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1)
    pool_timeout: float | None = Field(default=None, gt=0)
    native_responses: bool = False  # `type: openai`: the upstream serves /v1/responses itself (pass it through)
    # With native_responses: let `previous_response_id` / `conversation` / `store: true` through. Off by default:
    # the upstream key is shared by every tenant, so one could reference another's stored responses (SECURITY.md).
    allow_stored_responses: bool = False
    pricing: PricingConfig | None = None  # overrides the model's pricing for requests this deployment serves
    # Output limits (docs/coding-agents.md). `context_length`: the upstream model's context in tokens (a local
    # deployment knows its own). `clamp_max_tokens`: a max_tokens that does not fit next to the prompt is lowered to
    # the room left instead of refused; None = on for `type: local` and for upstreams with a context_length.
    context_length: int | None = Field(default=None, ge=1)
    clamp_max_tokens: bool | None = None
    # The replica's Prometheus text (vLLM, SGLang, `unigate engine serve`): its own load, read every
    # `router.metrics_interval_s` for models with `routing: least_load` or `prefix_affinity`.
    metrics_url: str | None = None
    # With the model's `slo`: where this deployment's live concurrency limit starts (the model's `slo_seed` else).
    max_concurrency: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _unset_nulls(cls, data: Any) -> Any:
        """`default_max_tokens: null` (and the like) means what leaving the field out means: the engine setting."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in LocalModelSettings.model_fields)}
        return data

    @field_validator("api_key")
    @classmethod
    def _resolve_env(cls, value: str | None) -> str | None:
        if value is None or not value.startswith(_ENV_PREFIX):
            return value
        name = value[len(_ENV_PREFIX) :].strip()
        resolved = os.environ.get(name)
        if not resolved:
            raise ValueError(f"environment variable {name} is not set; export {name}=<key> before starting")
        return resolved

    @model_validator(mode="after")
    def _check_type_fields(self) -> DeploymentConfig:
        if self.type in ("openai", "anthropic") and not self.base_url:
            raise ValueError(f"a `type: {self.type}` deployment needs `base_url` (e.g. https://api.example.com/v1)")
        if self.type == "local" and self.base_url:
            raise ValueError("a `type: local` deployment takes `model_path`, not `base_url`")
        if self.base_url:
            _check_base_url(self.base_url)
        if self.metrics_url:
            _check_metrics_url(self.metrics_url)
        if self.type == "local" and self.context_length is not None:
            raise ValueError(
                "a `type: local` deployment knows its context length; set UNIGATE_ENGINE__MAX_MODEL_LEN instead"
            )
        for field in self.local_overrides():
            if self.type != "local" and field != "model_path":
                raise ValueError(f"`{field}` applies to `type: local` deployments only; remove it")
        if self.type != "local" and self.clamp_max_tokens and self.context_length is None:
            raise ValueError(
                "`clamp_max_tokens: true` needs the upstream model's `context_length` (e.g. context_length: 128000)"
            )
        return self

    @model_serializer(mode="wrap")
    def _dump_own_local_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A dump names only the local fields the entry sets, so validating it again (the engine process does)
        gives the same overrides, not every field set to its default."""
        data: dict[str, Any] = handler(self)
        return {k: v for k, v in data.items() if k not in LocalModelSettings.model_fields or k in self.model_fields_set}

    def local_overrides(self) -> dict[str, Any]:
        """The `LocalModelSettings` fields this entry sets, by name (in declaration order)."""
        return {name: getattr(self, name) for name in LocalModelSettings.model_fields if name in self.model_fields_set}

    @property
    def clamps_max_tokens(self) -> bool:
        """Whether an output limit too big for the context is lowered rather than refused (see the field)."""
        if self.clamp_max_tokens is not None:
            return self.clamp_max_tokens
        return self.type == "local" or self.context_length is not None

    def upstream_model(self, requested: str) -> str:
        """The name sent upstream for a request that asked for `requested` (an id, alias or wildcard match)."""
        if self.id.endswith("*"):
            suffix = requested[len(self.id) - 1 :]
            if self.model is None:
                return suffix
            return self.model.replace("*", suffix) if "*" in self.model else self.model
        return self.model or self.id


class AffinityConfig(BaseModel):
    """`routing: prefix_affinity`: how a request's key is made and how far load may pull it off its replica."""

    model_config = ConfigDict(extra="forbid")

    block_chars: int = Field(default=256, ge=16, le=65536)
    max_blocks: int = Field(default=64, ge=1, le=4096)
    load_factor: float = Field(default=1.5, ge=1.0, le=100.0)  # consistent hashing with bounded loads' `c`
    load_slack: int = Field(default=0, ge=0, le=10_000)  # requests a deployment may take above that bound
    session_keys: bool = True


class SloConfig(BaseModel):
    """A model's SLO and its admission queue (gateway/slo_admission.py): at least one of `ttft_ms` / `tpot_ms`."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    max_queue: int = Field(default=64, ge=0, le=1_000_000)  # waiting requests per deployment
    max_wait_ms: float | None = Field(default=None, gt=0)  # a waiting request's deadline; see `max_wait_s`
    max_limit: int = Field(default=256, ge=1, le=1_000_000)  # the live limit's ceiling per deployment

    @model_validator(mode="after")
    def _check_targets(self) -> SloConfig:
        if self.ttft_ms is None and self.tpot_ms is None:
            raise ValueError("an `slo` needs `ttft_ms` and/or `tpot_ms` (e.g. slo: {ttft_ms: 500, tpot_ms: 50})")
        return self

    @property
    def max_wait_s(self) -> float:
        """How long a request may wait for a place: `max_wait_ms`, else half of `ttft_ms` (the other half is the
        deployment's), else one second."""
        if self.max_wait_ms is not None:
            return self.max_wait_ms / 1000
        return self.ttft_ms / 2000 if self.ttft_ms is not None else 1.0


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    aliases: list[str] = Field(default_factory=list)
    deployments: list[DeploymentConfig] = Field(min_length=1)
    pricing: PricingConfig | None = None  # None: requests of this model cost 0 (and usage says they are unpriced)
    routing: RoutingPolicy = "least_in_flight"
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    slo: SloConfig | None = None  # None: admitted as without SLO (no queue, no limit, no per-request work)
    slo_seed: str | None = None  # a `unigate bench --slo ... --out` run file (read when the file is loaded)
    _seed_concurrency: int | None = PrivateAttr(default=None)

    @field_validator("id")
    @classmethod
    def _check_wildcard(cls, value: str) -> str:
        if "*" in value and (value.count("*") > 1 or not value.endswith("*")):
            raise ValueError("a wildcard id may only end with '*' (e.g. `openai/*`)")
        return value

    @model_validator(mode="after")
    def _name_deployments(self) -> ModelConfig:
        for index, deployment in enumerate(self.deployments):
            deployment.id = self.id
            if not deployment.name:
                deployment.name = f"{self.id}#{index}"
        return self

    @model_validator(mode="after")
    def _check_slo(self, info: ValidationInfo) -> ModelConfig:
        if self.slo is None:
            if self.slo_seed is not None or any(d.max_concurrency is not None for d in self.deployments):
                raise ValueError("`slo_seed` and a deployment's `max_concurrency` need the model's `slo`; add one")
            return self
        if self.slo_seed is not None:
            base_dir = info.context.get("base_dir") if isinstance(info.context, dict) else None
            path = Path(self.slo_seed)
            self._seed_concurrency = read_slo_seed(path if base_dir is None else Path(base_dir) / path)
        return self

    @property
    def is_wildcard(self) -> bool:
        return self.id.endswith("*")

    @property
    def seed_concurrency(self) -> int | None:
        """`slo_seed`'s max concurrency meeting the SLO (None without `slo_seed`)."""
        return self._seed_concurrency


def read_slo_seed(path: Path) -> int:
    """`slo_result.max_concurrency_meeting_slo` of a `unigate bench --slo ... --out` file (docs/bench.md)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(
            f"cannot read `slo_seed` '{path}' ({exc.strerror}); give a `unigate bench --out` file"
        ) from None
    except ValueError:
        raise ValueError(f"`slo_seed` '{path}' is not JSON; give a `unigate bench --slo ... --out` file") from None
    result = data.get("slo_result") if isinstance(data, dict) else None
    value = result.get("max_concurrency_meeting_slo") if isinstance(result, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`slo_seed` '{path}' has no `slo_result.max_concurrency_meeting_slo` (a concurrency run with --slo whose "
            "lowest level met the SLO); run `unigate bench --concurrency ... --slo ...` or set `max_concurrency`"
        )
    return value


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_retries: int = Field(default=2, ge=0)  # extra attempts on connect errors / 429 / 5xx
    retry_backoff_s: float = Field(default=0.05, ge=0)  # first backoff; doubles per attempt, full jitter
    max_backoff_s: float = Field(default=2.0, ge=0)  # a longer upstream Retry-After is not waited for
    cooldown_s: float = Field(default=30.0, ge=0)  # how long a failing deployment is taken out
    max_retry_after_s: float = Field(default=300.0, ge=0)  # an upstream 429's Retry-After is honoured up to this
    max_fails: int = Field(default=3, ge=1)  # consecutive failures that trigger the cooldown
    metrics_interval_s: float = Field(default=1.0, gt=0)  # replicas' `metrics_url` polled this often
    metrics_timeout_s: float = Field(default=0.5, gt=0)  # a poll not answered in time has failed
    metrics_stale_s: float = Field(default=3.0, gt=0)  # older load figures give way to the in-flight counts


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelConfig] = Field(default_factory=list)
    fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _check_names(self) -> RoutingConfig:
        seen: dict[str, str] = {}
        deployment_names: set[str] = set()
        for model in self.models:
            for name in (model.id, *model.aliases):
                if name in seen:
                    raise ValueError(f"model name {name!r} is used twice ({seen[name]}); give each a unique id/alias")
                seen[name] = f"by model {model.id!r}"
            for deployment in model.deployments:
                if deployment.name in deployment_names:
                    raise ValueError(f"deployment name {deployment.name!r} is used twice; names must be unique")
                deployment_names.add(deployment.name)
        for source, targets in self.fallbacks.items():
            for name in (source, *targets):
                if name not in seen and not any(m.is_wildcard and name.startswith(m.id[:-1]) for m in self.models):
                    raise ValueError(f"fallbacks name {name!r}, which no model entry defines; add it under `models`")
        return self


def parse_routing(data: Any, *, source: str, base_dir: Path | None = None) -> RoutingConfig:
    """Validate an already-loaded YAML document; errors name `source`, the field path and the fix. A relative
    `slo_seed` is read from `base_dir` (the routing file's directory), else from the working directory."""
    if data is None:
        data = {}
    try:
        return RoutingConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise RoutingConfigError(_describe(exc, source)) from None


def load_routing(path: Path) -> RoutingConfig:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RoutingConfigError(
            f"{path}: cannot read the routing file ({exc.strerror}). Fix UNIGATE_CONFIG / --config or create it."
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RoutingConfigError(f"{path}: not valid YAML ({exc}). Fix the syntax at the position shown.") from None
    return parse_routing(data, source=str(path), base_dir=path.parent)


def default_routing(settings: Settings) -> RoutingConfig:
    """No routing file: the bundled local model when the engine is enabled, otherwise an empty table."""
    if not settings.engine.enabled:
        return RoutingConfig()
    engine = settings.engine
    deployment = {"type": "local", "model_path": engine.model_path}
    return parse_routing(
        {"models": [{"id": engine.model_id, "aliases": engine.aliases, "deployments": [deployment]}]},
        source="<default engine settings>",
    )


_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or check its spelling",
    "literal_error": "use one of the allowed values",
    "greater_than": "use a positive number",
    "greater_than_equal": "use a larger number",
    "too_short": "list at least one entry",
}


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid routing file:"]
    for error in exc.errors():
        location = _format_location(error["loc"])
        fix = _FIXES.get(error["type"], "fix the value")
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"  - {location or '<top level>'}: {message} ({fix})")
    return "\n".join(lines)


def _format_location(location: tuple[int | str, ...]) -> str:
    text = ""
    for part in location:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def _check_metrics_url(metrics_url: str) -> None:
    parts = urlsplit(metrics_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("`metrics_url` must be an http(s) URL with a host, e.g. http://gpu-host-1:8000/metrics")
    if parts.username is not None or parts.password is not None:
        raise ValueError("`metrics_url` must not hold credentials (user:password@)")


def _check_base_url(base_url: str) -> None:
    """An http(s) URL with a host and nothing the gateway would send elsewhere or drop: no credentials (they would
    reach the upstream next to the deployment's key, and show in logs), no query or fragment."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("`base_url` must be an http(s) URL with a host, e.g. https://api.example.com/v1")
    if parts.username is not None or parts.password is not None:
        raise ValueError("`base_url` must not hold credentials (user:password@); put the upstream key in `api_key`")
    if parts.query or parts.fragment:
        raise ValueError("`base_url` must not have a query or fragment; give the API's base path only")
