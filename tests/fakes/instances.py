"""Production gateways (`gateway.server.build_app`) for a routing table, one per name, sharing one real Redis."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fakes.app import MASTER
from fakes.server import ThreadedServer
from gateway.server import build_app
from gateway.settings import Settings

__all__ = ["gateway_instances"]


@contextmanager
def gateway_instances(
    redis_url: str | Sequence[str],
    directory: Path,
    models: list[dict[str, Any]],
    names: tuple[str, ...] = ("a", "b"),
    *,
    fallbacks: dict[str, list[str]] | None = None,
    router: dict[str, Any] | None = None,
) -> Iterator[list[ThreadedServer]]:
    """`with gateway_instances(redis_url, tmp_path, models) as (a, b):` — each instance has its own data dir; a
    sequence of URLs gives each instance its own way to the same Redis (e.g. one through a `DelayingProxy`)."""
    urls = [redis_url] * len(names) if isinstance(redis_url, str) else list(redis_url)
    routing = directory / "unigate.yaml"
    routing.write_text(yaml.safe_dump({"models": models, "fallbacks": fallbacks or {}, "router": router or {}}))
    servers = []
    try:
        for name, url in zip(names, urls, strict=True):
            settings = Settings(
                _env_file=None,  # type: ignore[call-arg]
                config=routing,
                master_key=MASTER,  # type: ignore[arg-type]
                redis_url=url,
                data_dir=directory / name,
                engine={"enabled": False},  # type: ignore[arg-type]
                health_probe_interval_s=0,
            )
            servers.append(ThreadedServer(build_app(settings)).start())
        yield servers
    finally:
        for server in servers:
            server.stop()
