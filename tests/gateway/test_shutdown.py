"""Graceful shutdown of a real `gateway.server.run` process on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from fakes.app import AUTH, CHAT, MASTER
from fakes.net import free_port
from fakes.upstream import Behavior, FakeUpstream

ROOT = Path(__file__).resolve().parents[2]


def start_gateway(tmp_path: Path, upstream: FakeUpstream, *, grace_s: float) -> tuple[subprocess.Popen[bytes], str]:
    routing = tmp_path / "unigate.yaml"
    routing.write_text(
        f"models:\n  - id: gpt-test\n    deployments: [{{type: openai, base_url: '{upstream.base_url}', api_key: k}}]\n"
    )
    port = free_port()
    env = {
        **os.environ,
        "UNIGATE_CONFIG": str(routing),
        "UNIGATE_MASTER_KEY": MASTER,
        "UNIGATE_PORT": str(port),
        "UNIGATE_ENGINE__ENABLED": "false",
        "UNIGATE_SHUTDOWN_GRACE_S": str(grace_s),
        "UNIGATE_LOG_FORMAT": "json",
        "UNIGATE_DATA_DIR": str(tmp_path / "data"),
    }
    code = "from gateway.server import run; from gateway.settings import Settings; run(Settings(_env_file=None))"
    process = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.05)
    return process, f"http://127.0.0.1:{port}"


async def collect(url: str) -> list[Any]:
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]))
    return events


async def test_sigterm_lets_short_streams_finish_and_cuts_long_ones_with_an_error(
    tmp_path: Path, fake_upstream: FakeUpstream
) -> None:
    fake_upstream.queue(
        Behavior(mode="slow", inter_token_s=0.15, num_chunks=4),  # finishes inside the grace period
        Behavior(mode="slow", inter_token_s=0.2, num_chunks=200),  # cannot finish
    )
    process, url = start_gateway(tmp_path, fake_upstream, grace_s=1.5)
    try:
        short = asyncio.ensure_future(collect(url))
        while fake_upstream.num_open_streams < 1:
            await asyncio.sleep(0.01)
        long = asyncio.ensure_future(collect(url))
        while fake_upstream.num_open_streams < 2:
            await asyncio.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        short_events, long_events = await asyncio.gather(short, long)
        # uvicorn re-raises the captured SIGTERM once shutdown is complete, so the exit status says "terminated".
        assert await asyncio.to_thread(process.wait, 15) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
    assert short_events[-1] == "[DONE]" and not any("error" in e for e in short_events if isinstance(e, dict))
    assert long_events[-1] == "[DONE]"
    assert long_events[-2]["error"]["code"] == "server_shutting_down"
    assert fake_upstream.num_open_streams == 0 and fake_upstream.num_streams_aborted == 1
    logs = process.stderr.read().decode() if process.stderr else ""
    assert '"level":"info"' in logs  # JSON log lines
    # The cut stream ended properly (error event, [DONE]): no "Exception in ASGI application" traceback for it.
    assert "Exception in ASGI application" not in logs and "CancelledError" not in logs, logs
    assert "color_message" not in logs and "\\u001b[" not in logs, logs  # uvicorn's ANSI-coloured duplicate
