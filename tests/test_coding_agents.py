"""benchmarks/coding_agents.py's real-client runs (issue 20, item 5).

Without the CLIs the script says so and loads no model. With Claude Code installed (`npm install --prefix DIR
@anthropic-ai/claude-code`, then `AGENTS_DIR=DIR`, or `claude` on the PATH; skipped otherwise), the real CLI runs
two turns in the script's small-model configuration against a real gateway serving a tiny random model whose
output is forced (the bundled model samples; this checks the wiring, not the model): the one-line system prompt
reaches the model instead of Claude Code's own, with no tools, the forced answer comes back as the CLI's result,
and `--continue` resends the first turn so that the engine serves it from the prefix cache."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fakes import engine_models
from fakes.app import make_settings
from fakes.engine_models import ScriptedSampler, tiny_engine_options

from auth.base import MasterKeyAccess
from backends.local import LocalBackend, LocalBackendConfig
from gateway.app import create_app
from gateway.routing_config import parse_routing

ROOT = Path(__file__).resolve().parent.parent
ANSWER = "Hello from the gateway."

# A subprocess or a CLI on a loaded 2-core machine: generous limits that bound hangs, not timing assertions.
pytestmark = pytest.mark.timeout(300)


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coding_agents", ROOT / "benchmarks" / "coding_agents.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


# The engine's session fixtures (the bundled model's tokenizer, a tiny random Llama with it).
bundled_checkpoint, real_tokenizer, tiny_model_dir = (
    engine_models.bundled_checkpoint,
    engine_models.real_tokenizer,
    engine_models.tiny_model_dir,
)
coding_agents = load_script()
AGENTS_DIR = Path(os.environ["AGENTS_DIR"]) if os.environ.get("AGENTS_DIR") else None
CLAUDE = coding_agents.find_cli("claude", AGENTS_DIR)


def test_absent_clis_are_reported_without_loading_a_model(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    if any((Path(d) / name).exists() for d in env["PATH"].split(":") for name in ("claude", "codex")):
        pytest.skip("a CLI is installed on the system PATH")
    result = subprocess.run(
        [sys.executable, "benchmarks/coding_agents.py", "--skip-http", "--agents-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"- {title}: {coding_agents.NOT_INSTALLED}" for title in ("Claude Code", "Codex CLI")
    ]


@pytest.fixture
def tiny_gateway(tiny_model_dir: Path, real_tokenizer: Any, tmp_path: Path) -> Iterator[tuple[Any, ScriptedSampler]]:
    # The tiny model's context is 256 tokens: room for the small configuration's prompt, not for Claude Code's own.
    engine = tiny_engine_options(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=256, block_size=16)
    backend = LocalBackend.from_local_config(LocalBackendConfig("tiny#0", "tiny", tmp_path / "models", engine))
    routing = parse_routing(
        {"models": [{"id": "tiny", "deployments": [{"type": "local", "name": "tiny#0"}]}]}, source="t"
    )
    app = create_app(
        make_settings(), access=MasterKeyAccess(coding_agents.KEY), routing=routing, backends={"tiny#0": backend}
    )
    running = coding_agents.Gateway(app, "tiny").start(timeout_s=120)
    assert backend.engine is not None
    [eos] = real_tokenizer.eos_token_ids
    sampler = ScriptedSampler(eos, real_tokenizer.encode(ANSWER))
    backend.engine.engine.sampler = sampler
    yield running, sampler
    running.stop()


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (AGENTS_DIR=DIR or claude on the PATH)")
def test_claude_code_small_configuration_answers_and_continues_from_the_cache(
    tiny_gateway: tuple[Any, ScriptedSampler], real_tokenizer: Any, tmp_path: Path
) -> None:
    running, sampler = tiny_gateway
    turns = coding_agents.claude_turns_cli(
        CLAUDE, running, tmp_path / "claude", 240.0, options=coding_agents.CLAUDE_SMALL_OPTIONS
    )

    for turn in turns:
        assert (turn.exit_code, turn.answer, turn.error) == (0, ANSWER, ""), "\n".join(
            coding_agents.describe_turn(turn)
        )
        [exchange] = [e for e in turn.exchanges if e.path == "/v1/messages"]
        assert exchange.status == 200
        assert coding_agents.finish(exchange.body) == ("end_turn", len(sampler.token_ids) + 1)  # (and the EOS)
    first, second = (real_tokenizer.decode(prompt, skip_special_tokens=False) for prompt in sampler.prompts)
    assert coding_agents.SMALL_SYSTEM_PROMPT in first and "Claude Code" not in first
    assert coding_agents.FIRST_PROMPT in first and second.startswith(first)
    assert ANSWER in second[len(first) :] and coding_agents.SECOND_PROMPT in second[len(first) :]
    prompt_tokens, cached_tokens = turns[1].main.tokens()
    assert prompt_tokens == len(sampler.prompts[1])
    assert cached_tokens >= len(sampler.prompts[0]) // 16 * 16  # every full block of turn 1's prompt
