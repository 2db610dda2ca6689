"""docker-compose.yml cannot run here: check its shape (services, ports, env, volumes) and the Dockerfile."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
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
    assert "UNIGATE_CONFIG" not in env  # set by the command only when the routing file exists (below)
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


def _bind_mounts(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(source, target, options) of each host bind mount (short syntax: a source that is a path, not a volume)."""
    mounts = []
    for volume in service["volumes"]:
        source, target, *options = str(volume).split(":")
        if source.startswith((".", "/", "~")):
            mounts.append((source, target, ",".join(options)))
    return mounts


def test_no_bind_mount_names_a_file_a_checkout_may_lack() -> None:
    """Docker creates a directory for a missing bind source: `./unigate.yaml` mounted by name became a directory the
    gateway could not read ("Is a directory"). Each bind source is a directory that a fresh checkout has."""
    gateway = load()["services"]["gateway"]
    mounts = _bind_mounts(gateway)
    assert mounts, "the gateway should see the project directory, where the optional routing file goes"
    for source, _, options in mounts:
        tracked = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "--", source], capture_output=True, text=True, check=True
        ).stdout
        assert (ROOT / source).is_dir() and tracked, f"{source}: not a directory every checkout has"
        assert "ro" in options.split(","), f"{source}: mounted writable"


def _run_gateway_command(directory: Path, tmp_path: Path) -> dict[str, str]:
    """The compose file's gateway command run by `sh` as the container would, with the mount target replaced by
    `directory` and a stand-in `unigate` on PATH that reports its arguments and UNIGATE_CONFIG."""
    gateway = load()["services"]["gateway"]
    [(_, target, _)] = _bind_mounts(gateway)
    command = gateway["command"]
    assert command[:2] == ["sh", "-c"] and target in command[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "unigate"
    stand_in.write_text('#!/bin/sh\necho "args=$*"\necho "config=${UNIGATE_CONFIG-}"\n')
    stand_in.chmod(0o755)
    script = command[2].replace(target, str(directory))
    result = subprocess.run(
        ["sh", "-c", script], env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, capture_output=True, text=True, check=True
    )
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


def test_the_routing_file_is_optional_under_compose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ./unigate.yaml the gateway serves the bundled model (as `make run` does); with it, the file."""
    from gateway.app import load_routing_for
    from gateway.settings import Settings

    monkeypatch.chdir(tmp_path)  # the container's working directory holds no unigate.yaml
    project = tmp_path / "project"
    project.mkdir()
    absent = _run_gateway_command(project, tmp_path)
    assert absent == {"args": "serve", "config": ""}
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert [m.id for m in load_routing_for(settings).models] == [settings.engine.model_id]

    routing = project / "unigate.yaml"
    routing.write_text("models:\n  - id: mine\n    deployments: [{type: openai, base_url: http://upstream.test/v1}]\n")
    present = _run_gateway_command(project, tmp_path)
    assert present == {"args": "serve", "config": str(routing)}
    configured = Settings(_env_file=None, config=Path(present["config"]))  # type: ignore[call-arg]
    assert [m.id for m in load_routing_for(configured).models] == ["mine"]
