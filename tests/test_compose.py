"""docker-compose.yml cannot run here: check its shape (services, ports, env, volumes) and the Dockerfile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def load() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def test_redis_persists_with_aof_on_a_volume() -> None:
    compose = load()
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:")
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert "redis-data:/data" in redis["volumes"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert "redis-data" in compose["volumes"]


def test_gateway_is_built_configured_by_env_and_published() -> None:
    compose = load()
    gateway = compose["services"]["gateway"]
    assert gateway["build"]["context"] == "."
    assert (ROOT / gateway["build"]["dockerfile"]).is_file()
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert any(str(p).endswith(":8080") for p in gateway["ports"])
    env = gateway["environment"]
    assert env["UNIGATE_REDIS_URL"] == "redis://redis:6379/0"  # the redis service by name
    assert env["UNIGATE_HOST"] == "0.0.0.0" and env["UNIGATE_PORT"] == "8080"
    assert "UNIGATE_MASTER_KEY" in env and ":?" in env["UNIGATE_MASTER_KEY"]  # required, never a default
    assert env["UNIGATE_CONFIG"] == "/etc/unigate/unigate.yaml"
    assert any(v.endswith(":/etc/unigate/unigate.yaml:ro") for v in gateway["volumes"])
    assert "gateway-data:/data" in gateway["volumes"] and "gateway-data" in compose["volumes"]
    grace = float(env["UNIGATE_SHUTDOWN_GRACE_S"])
    assert float(gateway["stop_grace_period"].rstrip("s")) > grace  # docker must not SIGKILL mid-grace


def test_every_env_name_is_a_setting() -> None:
    from gateway.settings import Settings

    fields = {f"UNIGATE_{name.upper()}" for name in Settings.model_fields}
    env = load()["services"]["gateway"]["environment"]
    unknown = [name for name in env if name.startswith("UNIGATE_") and name not in fields]
    assert unknown == [], unknown


def test_dockerfile_serves_on_8080() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 8080" in dockerfile
    assert 'CMD ["unigate", "serve"]' in dockerfile
    assert "HEALTHCHECK" in dockerfile and "/health/live" in dockerfile
