"""One engine per host: `unigate serve --workers 2` with a tiny random local model, as real processes on loopback.

The parent starts one engine process; both workers stream from it over its Unix socket (none loads torch), a client
that disconnects frees its sequence at once, an engine that dies is answered for with 503 and started again, and
SIGTERM stops every process and removes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
from fakes.app import MASTER
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.engine_host import get_state
from fakes.net import free_port

from backends.engine_protocol import ProtocolError

pytestmark = pytest.mark.timeout(90)

UNIGATE = Path(sys.executable).with_name("unigate")
ADMIN = {"authorization": f"Bearer {MASTER}"}
START_TIMEOUT_S = 60.0


def _tiny_checkpoint(directory: Path) -> Path:
    return tiny_llama_checkpoint(directory, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@dataclass
class Gateway:
    process: subprocess.Popen[bytes]
    url: str
    data_dir: Path

    @property
    def parent(self) -> psutil.Process:
        return psutil.Process(self.process.pid)

    def engine_processes(self) -> list[psutil.Process]:
        return [p for p in self.parent.children(recursive=True) if "gateway.engine_host" in " ".join(p.cmdline())]

    def worker_processes(self) -> list[psutil.Process]:
        return [p for p in self.parent.children() if "multiprocessing.spawn" in " ".join(p.cmdline())]

    def socket_path(self) -> Path:
        """The engine's Unix socket: under the data directory, or a private temporary one when that path is too long
        for a socket (as this module's data directories are for the test with the longest name)."""
        [engine] = self.engine_processes()
        [path] = {c.laddr for c in engine.net_connections(kind="unix") if str(c.laddr).endswith(".sock")}
        return Path(path)

    def engine_state(self) -> dict[str, Any]:
        """The engine process's own answer, over its socket (no worker in between, nothing cached)."""
        state = get_state(self.socket_path())
        return {"pid": state.pid, "state": state.state, "stats": state.stats}

    def is_engine_up(self, *, other_than: int) -> bool:
        try:
            state = self.engine_state()
        except (OSError, ProtocolError, ValueError, psutil.Error):
            return False  # (the new process is not listening yet)
        return state["pid"] != other_than and state["state"] == "up"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the local deployment is up (the engine loaded its model) in every worker: /health/ready answers
        from whichever worker accepts the connection, and each worker learns the engine's state by polling it every
        second (`EngineClientConfig.poll_interval_s`), so one worker can say `up` while another still says
        `loading` for up to a second after the engine loaded. Ready here: every answer, each on a new connection,
        says the engine is loaded for 3 s on end (three polls of every worker), and at least 10 of them."""
        deadline = time.monotonic() + timeout_s
        in_a_row, since = 0, 0.0
        while in_a_row < 10 or time.monotonic() - since < 3.0:
            assert self.process.poll() is None, "the gateway exited while starting"
            try:
                response = httpx.get(f"{self.url}/admin/engine", headers=ADMIN, timeout=5)
                loaded = response.status_code == 200 and all(s["loaded"] for s in response.json()["data"])
                ready = loaded and httpx.get(f"{self.url}/health/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                ready = False
            if ready and not in_a_row:
                since = time.monotonic()
            in_a_row = in_a_row + 1 if ready else 0
            assert time.monotonic() < deadline, "the gateway did not become ready"
            time.sleep(0.02 if ready else 0.05)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)


def start_gateway(tmp_path: Path, checkpoint: Path) -> Gateway:
    port = free_port()
    data_dir = tmp_path / "data"
    env = {
        **os.environ,
        "UNIGATE_MASTER_KEY": MASTER,
        "UNIGATE_PORT": str(port),
        "UNIGATE_DATA_DIR": str(data_dir),
        "UNIGATE_ENGINE__MODEL_PATH": str(checkpoint),  # no routing file: the default table, one local model
        "UNIGATE_ENGINE__DEVICE": "cpu",
        "UNIGATE_ENGINE__KV_CACHE_MEMORY": str(8 * 2**20),
        "UNIGATE_ENGINE__MAX_NUM_SEQS": "8",
        "UNIGATE_ENGINE__CPU_KERNELS": "false",
        "UNIGATE_ENGINE__PACK_CPU_WEIGHTS": "false",
        "UNIGATE_LOG_LEVEL": "warning",
    }
    process = subprocess.Popen([str(UNIGATE), "serve", "--workers", "2"], env=env, cwd=tmp_path)
    gateway = Gateway(process, f"http://127.0.0.1:{port}", data_dir)
    try:
        gateway.wait_ready()
    except BaseException:
        _kill_tree(process)
        raise
    return gateway


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    with_children = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for each in with_children:
        each.kill()
    psutil.wait_procs(with_children, timeout=10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Gateway]:
    gateway = start_gateway(tmp_path_factory.mktemp("workers"), checkpoint)
    yield gateway
    if gateway.process.poll() is None:
        try:
            gateway.stop()
        except subprocess.TimeoutExpired:
            _kill_tree(gateway.process)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "local", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}


async def stream_chat(url: str, body: dict[str, Any]) -> list[Any]:
    """One streamed call on its own connection: every `data:` event, parsed (`[DONE]` as the string)."""
    events: list[Any] = []
    async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]))
    return events


def test_one_engine_process_serves_every_worker_and_no_worker_loads_torch(gateway: Gateway) -> None:
    [engine] = gateway.engine_processes()
    workers = gateway.worker_processes()
    assert len(workers) == 2
    for worker in workers:  # the model and torch live in the engine process only
        assert not any("libtorch" in m.path for m in worker.memory_maps()), f"worker {worker.pid} loaded torch"
    assert any("libtorch" in m.path for m in engine.memory_maps())
    pids = set()
    for _ in range(8):  # a new connection each time: uvicorn's workers take turns accepting
        [stats] = httpx.get(f"{gateway.url}/admin/engine", headers=ADMIN).json()["data"]
        assert stats["loaded"] is True and stats["state"] == "up" and stats["max_model_len"] == 4096
        pids.add(stats["pid"])
    assert pids == {engine.pid}


async def test_streams_from_several_connections(gateway: Gateway) -> None:
    body = chat(temperature=0, stream_options={"include_usage": True})
    results = await asyncio.gather(*(stream_chat(gateway.url, body) for _ in range(6)))
    texts = set()
    for events in results:
        assert events[-1] == "[DONE]"
        usage = events[-2]["usage"]
        assert usage["completion_tokens"] == 8 and usage["prompt_tokens_details"]["cached_tokens"] >= 0
        texts.add("".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-2] if c["choices"]))
    assert len(texts) == 1  # greedy: the same answer from the one engine, whichever worker served it


def test_the_local_contract_holds_through_the_socket(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, headers=ADMIN, timeout=60) as client:
        clamped = client.post("/v1/chat/completions", json=chat(max_tokens=100_000))
        assert clamped.status_code == 200, clamped.text
        assert clamped.headers["x-unigate-max-tokens-clamped"].startswith("100000 -> ")
        prompt_tokens = clamped.json()["usage"]["prompt_tokens"]
        counted = client.post("/v1/messages/count_tokens", json=chat()).json()
        assert counted["input_tokens"] == prompt_tokens  # the engine's own tokenizer and chat template
        refused = client.post("/v1/chat/completions", json=chat(temperature=-1))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
        ready = client.get("/health/ready").json()
        assert list(ready["deployments"].values()) == ["up"]
        metrics = client.get("/metrics").text
        assert "unigate_engine_kv_blocks_total{" in metrics


async def test_a_disconnect_frees_the_sequence_at_once(gateway: Gateway) -> None:
    max_tokens = 4000
    body = chat(max_tokens=max_tokens, ignore_eos=True, stream=True)
    before = await asyncio.to_thread(gateway.engine_state)
    async with httpx.AsyncClient(base_url=gateway.url, headers=ADMIN, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.aiter_lines()  # held: dropping it mid-way would close the response already
            num_chunks = 0
            while num_chunks < 3:
                num_chunks += (await anext(lines)).startswith("data: {")
            running = (await asyncio.to_thread(gateway.engine_state))["stats"]["num_running_seqs"]
            assert running == 1
    closed_at = time.monotonic()
    while True:  # the worker aborts its call in the engine host, which aborts the request within a step
        stats = (await asyncio.to_thread(gateway.engine_state))["stats"]
        if stats["num_running_seqs"] == 0:
            break
        assert time.monotonic() - closed_at < 2.0, "the sequence still runs 2 s after the client left"
        await asyncio.sleep(0.01)
    generated = stats["generation_tokens_total"] - before["stats"]["generation_tokens_total"]
    assert generated < max_tokens  # cut short, not run to its end
    later = (await asyncio.to_thread(gateway.engine_state))["stats"]
    assert later["generation_tokens_total"] == stats["generation_tokens_total"]


def test_a_dead_engine_gets_503_then_a_new_one_and_sigterm_stops_everything(tmp_path: Path, checkpoint: Path) -> None:
    gateway = start_gateway(tmp_path, checkpoint)
    try:
        [engine] = gateway.engine_processes()
        socket_path = gateway.socket_path()
        engine.kill()
        engine.wait(10)
        started = time.monotonic()
        failed = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(), headers=ADMIN, timeout=30)
        assert time.monotonic() - started < 5.0  # answered, not hung
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"
        assert int(failed.headers["retry-after"]) >= 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while not gateway.is_engine_up(other_than=engine.pid):  # the parent starts a new one, which loads the model
            assert time.monotonic() < deadline, "no new engine process"
            time.sleep(0.05)
        served = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat(), headers=ADMIN, timeout=60)
        assert served.status_code == 200, served.text
        family = [gateway.parent, *gateway.parent.children(recursive=True)]
        assert gateway.stop() in (0, -signal.SIGTERM)
        _, alive = psutil.wait_procs(family, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
        assert not socket_path.exists()
        assert socket_path.parent == gateway.data_dir or not socket_path.parent.exists()  # a private dir is removed
        with socket.socket(socket.AF_INET) as probe:
            assert probe.connect_ex(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))) != 0
    finally:
        if gateway.process.poll() is None:
            _kill_tree(gateway.process)


def test_workers_and_engine_stop_when_the_parent_is_killed(tmp_path: Path, checkpoint: Path) -> None:
    """`kill -9` of `unigate serve --workers 2`: the workers (which would answer 503 forever, holding the port) and
    the engine stop by themselves, and a new `unigate serve` can take the port and the data directory."""
    gateway = start_gateway(tmp_path, checkpoint)
    port = int(gateway.url.rsplit(":", 1)[1])
    children = gateway.parent.children(recursive=True)
    redis_servers = [p for p in children if "redis-server" in " ".join(p.cmdline())]
    try:
        gateway.parent.kill()
        gateway.process.wait(10)
        _, alive = psutil.wait_procs([p for p in children if p not in redis_servers], timeout=20)
        assert alive == [], [p.cmdline() for p in alive]
        with socket.socket(socket.AF_INET) as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    finally:
        for process in children:  # the embedded Redis outlives a SIGKILLed owner (the next start attaches to it)
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
