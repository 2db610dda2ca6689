"""Two real `unigate engine serve` replicas of the bundled model behind a gateway with `routing: prefix_affinity`:
the gateway reads each engine's own metrics, keeps every conversation on one engine, and later turns are served
from that engine's prefix cache."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fakes.app import AUTH, asgi_client, build_app
from fakes.net import free_port

pytestmark = pytest.mark.timeout(600)

UNIGATE = Path(sys.executable).parent / "unigate"

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a terse assistant for a software team. Answer in at most five words. " * 4


@dataclass
class Engine:
    process: subprocess.Popen[bytes]
    url: str


def start_engine(data_dir: Path) -> Engine:
    """`unigate engine serve` in its own process (one engine per process, as on a GPU host)."""
    port = free_port()
    env = {
        **os.environ,
        "UNIGATE_DATA_DIR": str(data_dir),
        "UNIGATE_ENGINE__KV_CACHE_MEMORY": str(32 * 2**20),
        "UNIGATE_ENGINE__MAX_NUM_SEQS": "4",
        "UNIGATE_LOG_LEVEL": "warning",
    }
    command = [str(UNIGATE), "engine", "serve", "--port", str(port), "--api-key", "sk-engine"]
    return Engine(subprocess.Popen(command, env=env, cwd=data_dir), f"http://127.0.0.1:{port}")


def wait_ready(engine: Engine, deadline: float) -> bool:
    while time.monotonic() < deadline and engine.process.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{engine.url}/health/ready", timeout=5).status_code == 200:
                return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Engine]]:
    if not UNIGATE.exists():
        pytest.skip("the unigate command is not installed here")
    started = [start_engine(tmp_path_factory.mktemp(f"replica-{index}")) for index in range(2)]
    try:
        deadline = time.monotonic() + 400
        if not all(wait_ready(engine, deadline) for engine in started):
            pytest.skip("`unigate engine serve` did not start and load the bundled model here")
        yield started
    finally:
        for engine in started:
            engine.process.terminate()
        for engine in started:
            try:
                engine.process.wait(30)
            except subprocess.TimeoutExpired:
                engine.process.kill()
                engine.process.wait(10)


async def test_prefix_affinity_across_real_engine_replicas(engines: list[Engine]) -> None:
    deployments = [
        {
            "type": "openai",
            "name": f"engine-{i}",
            "base_url": f"{server.url}/v1",
            "api_key": "sk-engine",
            "model": MODEL,
            "metrics_url": f"{server.url}/metrics",
        }
        for i, server in enumerate(engines)
    ]
    routing = {
        "models": [{"id": "smol", "routing": "prefix_affinity", "deployments": deployments}],
        "router": {"metrics_interval_s": 0.1, "metrics_timeout_s": 2.0},
    }
    app = build_app(routing)
    async with asgi_client(app) as client:
        router = app.state.router
        for _ in range(300):  # the first round of polls: both engines' figures read (their own metric names)
            if all(d.replica.read_at > -math.inf for d in router.deployments):
                break
            await asyncio.sleep(0.05)
        assert all(d.replica.read_at > -math.inf for d in router.deployments)
        assert all(d.replica.num_failed_polls == 0 for d in router.deployments)
        counts: dict[int, list[tuple[int, int]]] = {}  # session -> (prompt tokens, cached tokens) per turn
        for session in range(4):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Name fruit {session}."}]
            for _turn in range(3):
                body = {"model": "smol", "messages": messages, "max_tokens": 4, "temperature": 0}
                response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
                assert response.status_code == 200, response.text
                data = response.json()
                usage = data["usage"]
                details = usage.get("prompt_tokens_details") or {}
                counts.setdefault(session, []).append((usage["prompt_tokens"], details.get("cached_tokens", 0)))
                messages = [
                    *messages,
                    {"role": "assistant", "content": data["choices"][0]["message"]["content"] or "ok"},
                    {"role": "user", "content": "And another?"},
                ]
    # every later turn found its whole previous prompt cached (up to the last partial KV block), not only the shared
    # system prompt: it went to the engine that served the turn before
    for turns in counts.values():
        for (previous_prompt, _), (_, cached) in itertools.pairwise(turns):
            assert cached >= previous_prompt - 32, counts
