"""Coding agents on the local model: Claude Code and Codex CLI through one gateway serving the bundled SmolLM2.

Both sections run against one in-process gateway (uvicorn, its lifespan, the bundled model on this machine's CPU or
GPU, the settings from the environment):

1. Agent-shaped turns over HTTP (no CLI needed). A Claude Code-shaped `/v1/messages` conversation and a Codex-shaped
   `/v1/responses` one: a long system prompt (this repository's docs, about 3,000 tokens), a tool list, Claude Code's
   per-request billing line in `system` and its agent list as a system message after the first user message; two
   turns each, streamed. Per request: prompt tokens and the cached ones as the client reads them
   (`cache_read_input_tokens`, `input_tokens_details.cached_tokens`), TTFT and wall time. A third request resends
   turn 2 with one character changed at the start of the system prompt: what a cache miss costs. The output limit
   is small here (`--max-tokens`): this section measures prompts, not generation.
2. The real clients, when installed (`npm install --prefix DIR @anthropic-ai/claude-code @openai/codex`, then
   `--agents-dir DIR`; or on the PATH): one non-interactive turn of each (`claude -p`, `codex exec`), then a second
   turn of the same session (`claude -p --continue`, `codex exec resume --last`), each in a scratch HOME with no
   login and no settings but the gateway's. Per turn: exit status, the answer's first words, wall time, the load
   average, and every request the gateway saw meanwhile (prompt and cached tokens, TTFT, how the answer ended, its
   tokens and the engine's tokens per second, `x-unigate-max-tokens-clamped`). A CLI that is not installed is
   reported as such. `--clients claude,claude-small` runs Claude Code as installed and in its small-model
   configuration (`CLAUDE_SMALL_OPTIONS`: a one-line system prompt, no tools), `--repeat N` each N times (the model
   samples at temperature 1).

Targets (issue 20), with the bundled model on a 2-core CPU: both agents answer (any text) a one-line prompt, each turn
takes under 60 s, and the second turn's prompt is served >= 90% from the prefix cache.

    .venv/bin/python benchmarks/coding_agents.py [--agents-dir /tmp/agents] [--skip-http] [--skip-cli]
        [--clients claude,claude-small,codex] [--repeat N] [--turn-timeout S]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from auth.base import MasterKeyAccess  # noqa: E402
from gateway.app import create_app  # noqa: E402
from gateway.output_limits import CLAMP_HEADER  # noqa: E402
from gateway.routing_config import default_routing  # noqa: E402
from gateway.settings import Settings  # noqa: E402

KEY = "sk-ug-coding-agents"
TARGET_TURN_S = 60.0
TARGET_CACHED = 0.90
NOT_INSTALLED = "not installed (npm install --prefix DIR @anthropic-ai/claude-code @openai/codex; --agents-dir DIR)"
FIRST_PROMPT = "Say hello in one line."
SECOND_PROMPT = "Now say goodbye in one line."
# Claude Code for a small local model (docs/coding-agents.md): its own system prompt (about 3,000 tokens with the
# environment it describes) replaced by one line, no built-in tools, and none of what --bare skips (hooks, plugin
# sync, auto-memory, background prefetches, CLAUDE.md discovery).
SMALL_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
CLAUDE_SMALL_OPTIONS = ("--bare", "--system-prompt", SMALL_SYSTEM_PROMPT, "--tools", "")
# The first event of an answer, in each API family's stream.
_DELTA = re.compile(rb'"type":\s*"(content_block_delta|response\.output_text\.delta|response\.output_item\.added)"')


# -- the gateway, and what it answered -----------------------------------------------------------------------------


@dataclass
class Exchange:
    """One POST the gateway answered: status, headers, times (s from the request) and the body it sent."""

    path: str
    started: float
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ttft_s: float | None = None
    wall_s: float | None = None
    last_s: float = 0.0  # the last chunk sent, also when the client went away before the end
    body: bytearray = field(default_factory=bytearray)

    def tokens(self) -> tuple[int, int] | None:
        """(prompt tokens, cached prompt tokens) from the usage the client reads; None when there was none."""
        return usage_tokens(self.body)

    def describe(self) -> str:
        tokens = self.tokens()
        usage = f"prompt {tokens[0]}, cached {tokens[1]} ({percent(tokens)})" if tokens else "no usage"
        ttft = f"TTFT {self.ttft_s:.1f} s, " if self.ttft_s is not None else ""
        clamp = f", {CLAMP_HEADER}: {self.headers[CLAMP_HEADER]}" if CLAMP_HEADER in self.headers else ""
        wall = f"{self.wall_s:.1f} s" if self.wall_s is not None else f"cut off after {self.last_s:.1f} s"
        return f"POST {self.path} {self.status}: {usage}; {ttft}{wall}; {self.describe_output()}{clamp}"

    def describe_output(self) -> str:
        """How the answer ended and how fast the engine wrote it (tokens after the first, per second)."""
        reason, num_tokens = finish(self.body)
        decode_s = (self.wall_s or self.last_s) - (self.ttft_s or 0.0)
        speed = f" at {(num_tokens - 1) / decode_s:.1f} tok/s" if num_tokens > 1 and decode_s > 0 else ""
        return f"{reason or 'no end'}, {num_tokens} tokens out{speed}"


class UsageTap:
    """ASGI middleware recording every POST's answer (the usage is read from the bytes the client gets)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["path"], time.perf_counter())
        self.exchanges.append(exchange)

        async def tap(message: Any) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                elapsed = time.perf_counter() - exchange.started
                if exchange.ttft_s is None and _DELTA.search(chunk):
                    exchange.ttft_s = elapsed
                exchange.body += chunk
                exchange.last_s = elapsed
                if not message.get("more_body"):
                    exchange.wall_s = elapsed
            await send(message)

        await self.app(scope, receive, tap)


def usage_tokens(body: bytes) -> tuple[int, int] | None:
    text = body.decode("utf-8", errors="replace")
    events: list[Any] = []
    if text.lstrip().startswith("{"):
        events.append(_json(text))
    else:
        events += [_json(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    found = None
    for event in events:
        if not isinstance(event, dict):
            continue
        response = event.get("response")
        usage = event.get("usage") or (response.get("usage") if isinstance(response, dict) else None)
        if isinstance(usage, dict) and event.get("type") != "message_start":  # (message_start holds an estimate)
            found = usage
    return None if found is None else _normalise(found)


def finish(body: bytes | bytearray) -> tuple[str | None, int]:
    """(how the answer ended, output tokens) from a streamed Anthropic or Responses answer: the stop reason the client
    reads (`stop_reason`; `incomplete_details.reason` or `status`), None when the stream was cut before it, and the
    usage's output tokens, else the number of text deltas sent."""
    reason, num_tokens, num_deltas = None, None, 0
    for line in body.decode("utf-8", errors="replace").splitlines():
        event = _json(line[5:]) if line.startswith("data:") else None
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        if kind in ("content_block_delta", "response.output_text.delta"):
            num_deltas += 1
        delta, response = event.get("delta"), event.get("response")
        if kind == "message_delta" and isinstance(delta, dict):  # Anthropic
            reason, num_tokens = delta.get("stop_reason"), (event.get("usage") or {}).get("output_tokens")
        elif kind in ("response.completed", "response.incomplete") and isinstance(response, dict):  # Responses
            incomplete = response.get("incomplete_details") or {}
            reason = incomplete.get("reason") or response.get("status")
            num_tokens = (response.get("usage") or {}).get("output_tokens")
    return reason, num_tokens if isinstance(num_tokens, int) else num_deltas


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _normalise(usage: dict[str, Any]) -> tuple[int, int]:
    if "prompt_tokens" in usage:  # chat completions
        return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if "input_tokens_details" in usage:  # Responses
        return usage["input_tokens"], (usage["input_tokens_details"] or {}).get("cached_tokens", 0)
    cached = usage.get("cache_read_input_tokens") or 0  # Anthropic: counted apart from input_tokens
    return usage.get("input_tokens", 0) + cached + (usage.get("cache_creation_input_tokens") or 0), cached


def percent(tokens: tuple[int, int] | None) -> str:
    return f"{100 * tokens[1] / tokens[0]:.1f}%" if tokens and tokens[0] else "-"


class Gateway:
    """A gateway app serving `model` to the key `KEY`, under uvicorn in a thread, its answers recorded."""

    def __init__(self, app: Any, model: str) -> None:
        self.model = model
        self.tap = UsageTap(app)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(self.tap, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    @classmethod
    def bundled(cls, data_dir: Path) -> Gateway:
        """The gateway with the bundled model (the default routing table), the settings from the environment."""
        settings = Settings(_env_file=None, master_key=KEY, data_dir=data_dir, health_probe_interval_s=0)  # type: ignore[call-arg]
        app = create_app(settings, access=MasterKeyAccess(KEY), routing=default_routing(settings))
        return cls(app, settings.engine.model_id)

    def start(self, timeout_s: float = 600.0) -> Gateway:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health/ready", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the gateway did not become ready (the model did not load?)")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# -- 1. agent-shaped turns over HTTP -------------------------------------------------------------------------------


def system_text(agent: str, num_chars: int) -> str:
    """A long, stable system prompt: the repository's own docs, after a first line that differs per agent (so one
    agent's turns find nothing of the other's in the prefix cache)."""
    text = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    return (
        f"You are {agent}, a coding agent working in the unigate repository. Its documentation:\n\n" + text[:num_chars]
    )


CLAUDE_TOOLS = [
    {"name": name, "description": f"{name} a file or run a command.", "input_schema": {"type": "object"}}
    for name in ("Bash", "Read", "Edit", "Write", "Glob", "Grep")
]
CODEX_TOOLS = [
    {"type": "function", "name": name, "description": f"Codex's {name} tool.", "parameters": {"type": "object"}}
    for name in ("shell", "update_plan", "view_image")
]


# Claude Code 2.1.197 lists its Agent tool's agent types in a system message after the first user message (6 KB).
AGENT_LIST = "Available agent types for the Agent tool:\n" + "".join(
    f"- {name}: {role} agent. (Tools: {tools})\n"
    for name, role, tools in (("claude", "Catch-all", "*"), ("Explore", "Read-only search", "Read, Glob, Grep"))
)


def billing_line(nonce: str) -> dict[str, Any]:
    """Claude Code's first `system` block; `cch` changes on every request."""
    return {
        "type": "text",
        "text": f"x-anthropic-billing-header: cc_version=2.1.197.{nonce}; cc_entrypoint=cli; cch={nonce};",
    }


def first_turn(path: str, model: str, system: str, max_tokens: int) -> dict[str, Any]:
    if path == "/v1/messages":
        return {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "system": [billing_line("36ee5"), {"type": "text", "text": system}],
            "tools": CLAUDE_TOOLS,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": FIRST_PROMPT}]},
                {"role": "system", "content": AGENT_LIST},  # after the first user message, as Claude Code sends it
            ],
        }
    return {
        "model": model,
        "instructions": system,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": FIRST_PROMPT}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "stream": True,
        "max_output_tokens": max_tokens,
    }


def next_turn(path: str, body: dict[str, Any], answer: str) -> dict[str, Any]:
    """`body` with the answer and the second prompt appended, as the client sends its next turn."""
    if path == "/v1/messages":
        messages = [
            *body["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": SECOND_PROMPT}]},
        ]
        return {**body, "system": [billing_line("0aaa9"), body["system"][1]], "messages": messages}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]}
    asked = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SECOND_PROMPT}]}
    return {**body, "input": [*body["input"], said, asked]}


def changed_prefix(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == "/v1/messages":
        billing, prompt = body["system"]
        return {**body, "system": [billing, {**prompt, "text": "%" + prompt["text"][1:]}]}
    return {**body, "instructions": "%" + body["instructions"][1:]}


def stream_answer(client: httpx.Client, path: str, body: dict[str, Any]) -> str:
    text = []
    with client.stream("POST", path, json=body) as response:
        for line in response.iter_lines():
            event = _json(line[5:]) if line.startswith("data:") else None
            if isinstance(event, dict):
                delta = event.get("delta")
                if isinstance(delta, dict) and delta.get("type") == "text_delta":
                    text.append(delta["text"])
                elif event.get("type") == "response.output_text.delta":
                    text.append(event["delta"])
    return "".join(text)


def http_section(gateway: Gateway, args: argparse.Namespace) -> list[str]:
    headers = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    lines = [
        "## Agent-shaped turns over HTTP",
        "",
        "| shape | request | prompt tokens | cached | cached % | TTFT s | wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=600) as client:
        for shape, path in (("Claude Code", "/v1/messages"), ("Codex", "/v1/responses")):
            first = first_turn(path, gateway.model, system_text(shape, args.system_chars), args.max_tokens)
            answer = ""
            for name in ("turn 1", "turn 2", "turn 2, prefix changed"):
                if name == "turn 1":
                    body = first
                elif name == "turn 2":
                    body = second = next_turn(path, first, answer)
                else:
                    body = changed_prefix(path, second)
                mark = len(gateway.tap.exchanges)
                answer = stream_answer(client, path, body)
                [exchange] = gateway.tap.exchanges[mark:]
                tokens = exchange.tokens() or (0, 0)
                ttft = f"{exchange.ttft_s:.2f}" if exchange.ttft_s is not None else "-"
                row = [shape, name, str(tokens[0]), str(tokens[1]), percent(tokens), ttft, f"{exchange.wall_s:.2f}"]
                lines.append("| " + " | ".join(row) + " |")
                print(lines[-1], flush=True)
    return lines


# -- 2. the real clients --------------------------------------------------------------------------------------------


@dataclass
class Turn:
    name: str
    exit_code: int | None
    answer: str
    wall_s: float
    exchanges: list[Exchange]
    error: str = ""
    load: tuple[float, ...] = ()  # the load average (1, 5, 15 min) as the turn started

    @property
    def main(self) -> Exchange | None:
        """The turn's request with the longest prompt (clients add small side requests, e.g. titles)."""
        counted = [e for e in self.exchanges if e.tokens()]
        return max(counted, key=lambda e: (e.tokens() or (0, 0))[0], default=None)


class TurnsRunner(Protocol):
    def __call__(self, binary: str, gateway: Gateway, directory: Path, timeout_s: float) -> list[Turn]: ...


def find_cli(name: str, agents_dir: Path | None) -> str | None:
    if agents_dir is not None:
        candidate = agents_dir / "node_modules" / ".bin" / name
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)


def run_turn(name: str, command: list[str], env: dict[str, str], cwd: Path, gateway: Gateway, timeout_s: float) -> Turn:
    mark = len(gateway.tap.exchanges)
    load = os.getloadavg()
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
        exit_code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        exit_code, stdout = None, expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        stderr = f"killed after {timeout_s:.0f} s"
    wall_s = time.perf_counter() - started
    answer, error = read_answer(stdout)
    if exit_code != 0 and not error:
        tail = (stderr or stdout).strip().splitlines()
        error = tail[-1] if tail else ""
    return Turn(name, exit_code, answer, wall_s, gateway.tap.exchanges[mark:], error[:300], load)


def read_answer(stdout: str) -> tuple[str, str]:
    """(answer, error) from `claude -p --output-format json` or `codex exec --json` output."""
    answer, error = "", ""
    for line in stdout.splitlines():
        event = _json(line)
        if not isinstance(event, dict):
            continue
        if event.get("type") == "result":  # Claude Code
            text = str(event.get("result") or "")
            answer, error = ("", text) if event.get("is_error") else (text, "")
        item = event.get("item") if isinstance(event.get("item"), dict) else {}
        if event.get("type") == "item.completed" and item.get("type") == "agent_message":  # Codex
            answer = str(item.get("text") or "")
        elif event.get("type") in ("error", "turn.failed"):
            error = json.dumps(event)[:300]
    return answer, error


def base_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb"}


def claude_turns_cli(
    binary: str, gateway: Gateway, directory: Path, timeout_s: float, options: tuple[str, ...] = ()
) -> list[Turn]:
    home, work = directory / "home", directory / "work"
    home.mkdir(parents=True)
    work.mkdir()
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": gateway.url,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_MODEL": gateway.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": gateway.model,
        "ANTHROPIC_SMALL_FAST_MODEL": gateway.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    # The options come first: `--tools` takes every argument up to the next option, the prompt included.
    command = [binary, *options, "-p", "--output-format", "json", "--model", gateway.model]
    return [
        run_turn("turn 1", [*command, FIRST_PROMPT], env, work, gateway, timeout_s),
        run_turn("turn 2", [*command, "--continue", SECOND_PROMPT], env, work, gateway, timeout_s),
    ]


def codex_turns_cli(binary: str, gateway: Gateway, directory: Path, timeout_s: float) -> list[Turn]:
    home, codex_home, work = directory / "home", directory / "config", directory / "work"
    for path in (home, codex_home, work):
        path.mkdir(parents=True)
    (codex_home / "config.toml").write_text(
        f'model = "{gateway.model}"\nmodel_provider = "unigate"\n\n[model_providers.unigate]\nname = "unigate"\n'
        f'base_url = "{gateway.url}/v1"\nenv_key = "UNIGATE_API_KEY"\nwire_api = "responses"\n'
    )
    env = base_env(home) | {"CODEX_HOME": str(codex_home), "UNIGATE_API_KEY": KEY}
    command = [binary, "exec", "--skip-git-repo-check", "--json"]
    return [
        run_turn("turn 1", [*command, FIRST_PROMPT], env, work, gateway, timeout_s),
        run_turn("turn 2", [*command, "resume", "--last", SECOND_PROMPT], env, work, gateway, timeout_s),
    ]


CLIENTS = ("claude", "claude-small", "codex")


def client_names(text: str) -> list[str]:
    names = text.split(",")
    if unknown := [name for name in names if name not in CLIENTS]:
        raise argparse.ArgumentTypeError(f"unknown client {unknown[0]!r}: choose from {', '.join(CLIENTS)}")
    return names


def cli_runs(clients: list[str]) -> list[tuple[str, str, TurnsRunner]]:
    """(CLI, title, runner) for each client configuration named (`CLIENTS`), in that order."""
    runs: dict[str, tuple[str, str, TurnsRunner]] = {
        "claude": ("claude", "Claude Code", claude_turns_cli),
        "claude-small": (
            "claude",
            "Claude Code, small-model configuration",
            functools.partial(claude_turns_cli, options=CLAUDE_SMALL_OPTIONS),
        ),
        "codex": ("codex", "Codex CLI", codex_turns_cli),
    }
    return [runs[name] for name in clients]


def cli_section(gateway: Gateway, args: argparse.Namespace, scratch: Path) -> list[str]:
    """Each installed client configuration's two turns, `args.repeat` rounds of all of them (so that a load that
    changes meanwhile falls on every configuration alike)."""
    lines = ["## Claude Code and Codex CLI, two turns each", ""]
    installed = []
    for index, (name, title, runner) in enumerate(cli_runs(args.clients)):
        binary = find_cli(name, args.agents_dir)
        if binary is None:
            lines.append(f"- {title}: {NOT_INSTALLED}")
            print(lines[-1], flush=True)
            continue
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
        installed.append((f"{name}-{index}", f"{title} ({version})", binary, runner))
    for attempt in range(1, args.repeat + 1):
        for key, title, binary, runner in installed:
            lines += [f"### {title}" + (f", run {attempt} of {args.repeat}" if args.repeat > 1 else ""), ""]
            turns = runner(binary, gateway, scratch / f"{key}-{attempt}", args.turn_timeout)
            for turn in turns:
                lines += describe_turn(turn)
                print("\n".join(lines[-1 - len(turn.exchanges) - bool(turn.error) :]), flush=True)
            lines += ["", *verdict(turns), ""]
    return lines


def describe_turn(turn: Turn) -> list[str]:
    status = "answered" if turn.exit_code == 0 and turn.answer.strip() else f"failed (exit {turn.exit_code})"
    load = " ".join(f"{value:.2f}" for value in turn.load)
    lines = [f"- {turn.name}: {status} in {turn.wall_s:.1f} s (load {load}): {turn.answer.strip()[:100]!r}"]
    if turn.error:
        lines.append(f"  - error: {turn.error}")
    return lines + [f"  - {exchange.describe()}" for exchange in turn.exchanges]


def verdict(turns: list[Turn]) -> list[str]:
    answered = all(t.exit_code == 0 and t.answer.strip() for t in turns)
    slowest = max(t.wall_s for t in turns)
    main = turns[-1].main
    tokens = main.tokens() if main is not None else None
    cached = tokens[1] / tokens[0] if tokens and tokens[0] else 0.0
    return [
        f"- target, an answer on every turn: {'met' if answered else 'NOT met'}",
        f"- target, each turn under {TARGET_TURN_S:.0f} s: {'met' if slowest < TARGET_TURN_S else 'NOT met'} "
        f"(slowest {slowest:.1f} s)",
        f"- target, turn 2 >= {TARGET_CACHED:.0%} cached: {'met' if cached >= TARGET_CACHED else 'NOT met'} "
        f"({percent(tokens)})",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents-dir", type=Path, help="where `npm install --prefix` put the CLIs")
    parser.add_argument("--skip-http", action="store_true", help="skip the agent-shaped HTTP turns")
    parser.add_argument("--skip-cli", action="store_true", help="skip the real clients")
    parser.add_argument("--system-chars", type=int, default=12_000, help="system prompt size of the HTTP turns")
    parser.add_argument("--max-tokens", type=int, default=48, help="output limit of the HTTP turns")
    parser.add_argument("--turn-timeout", type=float, default=300.0, help="seconds before a CLI turn is killed")
    parser.add_argument(
        "--clients",
        type=client_names,
        default=["claude", "codex"],
        help="client configurations to run, in order: claude, claude-small (--bare, a one-line --system-prompt, "
        "--tools ''), codex (default: claude,codex)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each client configuration (they sample)")
    args = parser.parse_args()
    runs = cli_runs(args.clients)
    has_cli = not args.skip_cli and any(find_cli(name, args.agents_dir) for name, _, _ in runs)
    if args.skip_http and not has_cli:  # nothing to run: no model load
        print("\n".join(not_installed(args)))
        return
    with tempfile.TemporaryDirectory(prefix="coding-agents-") as tmp:
        scratch = Path(tmp)
        started = time.perf_counter()
        gateway = Gateway.bundled(scratch / "data").start()
        print(f"# Coding agents on {gateway.model} (gateway ready in {time.perf_counter() - started:.0f} s)\n")
        try:
            report = [] if args.skip_http else http_section(gateway, args)
            report += [""] + ([] if args.skip_cli else cli_section(gateway, args, scratch))
        finally:
            gateway.stop()
    print("\n" + "\n".join(report))


def not_installed(args: argparse.Namespace) -> list[str]:
    if args.skip_cli:
        return ["- Claude Code, Codex CLI: skipped (--skip-cli)"]
    return [f"- {title}: {NOT_INSTALLED}" for _, title, _ in cli_runs(args.clients)]


if __name__ == "__main__":
    main()
