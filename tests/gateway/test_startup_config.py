"""A bad setting stops start-up, before anything listens, with a message naming its environment variable and the
fix, and a non-zero exit (as a bad routing file does). The engine's options are declared once
(`local_engine.config.EngineConfig`) and validated when the settings are built, not in the model's loader thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from backends.config import LocalEngineOptions
from gateway.settings import EngineSettings, InvalidSettingsError, LocalModelSettings, Settings, load_settings
from local_engine.config import EngineConfig

UNIGATE = Path(sys.executable).with_name("unigate")
BLOCK_SIZE_ERROR = "UNIGATE_ENGINE__BLOCK_SIZE=24: block_size must be a positive power of two (e.g. 16 or 32)"


def run_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The installed `unigate` command, in an empty directory (no .env, no unigate.yaml), with only `env` set of
    the UNIGATE_* variables."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("UNIGATE_")}
    clean |= {"UNIGATE_DATA_DIR": str(tmp_path / "data"), "UNIGATE_PORT": "1", **env}
    command = [str(UNIGATE)] if UNIGATE.exists() else [sys.executable, "-c", "from gateway.cli import main; main()"]
    return subprocess.run(
        [*command, *args], env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize("command", [["serve"], ["engine", "serve", "--port", "1"]], ids=["serve", "engine-serve"])
def test_a_bad_engine_value_stops_the_server_before_it_starts(tmp_path: Path, command: list[str]) -> None:
    result = run_cli(tmp_path, *command, UNIGATE_ENGINE__BLOCK_SIZE="24")
    assert result.returncode == 1
    assert result.stderr.strip() == f"unigate: {BLOCK_SIZE_ERROR}"  # one line, no traceback
    assert not (tmp_path / "data").exists()  # nothing started: no master key, no embedded Redis


def test_every_bad_value_is_named_at_once(tmp_path: Path) -> None:
    result = run_cli(
        tmp_path,
        "serve",
        UNIGATE_ENGINE__MAX_NUM_SEQS="128",
        UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS="64",
        UNIGATE_ENGINE__GPU_MEMORY_UTILIZATION="1.5",
        UNIGATE_ENGINE__DEVICE="tpu",
        UNIGATE_PORT="http",
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "unigate: invalid settings:"
    assert sorted(line.split(":")[0].strip(" -") for line in lines[1:]) == [
        "UNIGATE_ENGINE__DEVICE=tpu",
        "UNIGATE_ENGINE__GPU_MEMORY_UTILIZATION=1.5",
        "UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS=64",
        "UNIGATE_PORT=http",
    ]
    assert "raise it or lower max_num_seqs" in result.stderr and "(e.g. 0.9)" in result.stderr


# -- the messages, in process ----------------------------------------------------------------------------------------


def settings_error(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettingsError) as info:
        load_settings(_env_file=None)
    return str(info.value)


def test_each_engine_check_says_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_error(monkeypatch, UNIGATE_ENGINE__BLOCK_SIZE="24") == BLOCK_SIZE_ERROR
    monkeypatch.delenv("UNIGATE_ENGINE__BLOCK_SIZE")
    assert settings_error(monkeypatch, UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS="8") == (
        "UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS=8: max_num_batched_tokens (8) must be >= max_num_seqs (64) so every "
        "running sequence can decode each step: raise it or lower max_num_seqs"
    )
    monkeypatch.delenv("UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS")
    assert settings_error(monkeypatch, UNIGATE_ENGINE__GPU_MEMORY_UTILIZATION="0").startswith(
        "UNIGATE_ENGINE__GPU_MEMORY_UTILIZATION=0: gpu_memory_utilization must be in (0, 1]"
    )


def test_a_list_setting_is_named_without_its_index_and_bad_json_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_error(monkeypatch, UNIGATE_ENGINE__ALIASES="[1]") == (
        "UNIGATE_ENGINE__ALIASES: Input should be a valid string"
    )
    message = settings_error(monkeypatch, UNIGATE_ENGINE__ALIASES="local")
    assert "UNIGATE_ENGINE__ALIASES='[\"local\"]'" in message and "JSON" in message


def test_a_secret_is_never_printed() -> None:
    with pytest.raises(InvalidSettingsError) as info:
        load_settings(_env_file=None, master_key=12345678)
    assert str(info.value) == "UNIGATE_MASTER_KEY: Input should be a valid string"


def test_a_bare_uvicorn_worker_exits_with_the_same_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.server import _SETTINGS_ENV, app_from_env

    monkeypatch.delenv(_SETTINGS_ENV, raising=False)
    monkeypatch.setenv("UNIGATE_ENGINE__BLOCK_SIZE", "24")
    monkeypatch.chdir(Path(__file__).parent)  # no .env here
    with pytest.raises(SystemExit) as info:
        app_from_env()
    assert info.value.code == f"unigate: {BLOCK_SIZE_ERROR}"


def test_good_values_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIGATE_ENGINE__BLOCK_SIZE", "32")
    monkeypatch.setenv("UNIGATE_ENGINE__MAX_NUM_BATCHED_TOKENS", "64")
    settings = load_settings(_env_file=None)
    assert settings.engine.block_size == 32 and settings.engine.max_num_batched_tokens == 64


# -- one declaration per engine option ----------------------------------------------------------------------------


def test_engine_settings_declare_only_the_gateways_own_fields() -> None:
    own = set(EngineSettings.__annotations__)
    assert own == {"enabled", "model_id", "aliases"}  # `load_wait_s` and the rest: the local backend's options
    assert set(EngineConfig.model_fields) < set(LocalEngineOptions.model_fields) < set(EngineSettings.model_fields)
    assert set(LocalModelSettings.model_fields) < set(EngineSettings.model_fields)  # declared there, once
    assert isinstance(Settings.model_fields["engine"].get_default(call_default_factory=True), BaseModel)


def test_the_engine_takes_the_run_options_alone() -> None:
    settings = EngineSettings(block_size=32, model_id="m", device="cpu")
    config = settings.engine_config()
    assert type(config) is EngineConfig and config.block_size == 32 and config.device == "cpu"
    assert config == EngineConfig(block_size=32, device="cpu")
    assert EngineConfig.of(config) is config


@pytest.mark.parametrize("name", ["REDIS_TIMEOUT_S", "LEASE_TTL_S", "POOL_TIMEOUT_S"])
@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_limit_timeouts_must_be_positive(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """A Redis timeout of 0 would make every call time out: Redis "down" forever, from a typo."""
    message = settings_error(monkeypatch, **{f"UNIGATE_LIMITS__{name}": value})
    assert message.startswith(f"UNIGATE_LIMITS__{name}={value}:"), message
