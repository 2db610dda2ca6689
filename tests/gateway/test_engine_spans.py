"""The local engine's queue, prefill and decode as spans (issue 39, item 3): a real gateway serves a tiny random model
(in its own process, and through the engine host as `--workers N` does: the engine's times then come over its
socket), traced to an OTLP receiver in this process. Each local request's trace has `unigate.engine.queue`,
`unigate.engine.prefill` and `unigate.engine.decode` under its attempt, one after the other, inside the request's
span; a stream the client cut shows the stages it reached."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from fakes.access import RecordingAccess
from fakes.app import MASTER, make_settings
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.engine_host import ThreadedEngineHost, tiny_local_backend
from fakes.otlp import OtlpReceiver, span_attributes
from fakes.server import ThreadedServer

from gateway.app import create_app
from gateway.routing_config import parse_routing

NAME = "local#0"
AUTH = {"authorization": f"Bearer {MASTER}"}
STAGES = ("unigate.engine.queue", "unigate.engine.prefill", "unigate.engine.decode")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about spring"}], "max_tokens": 6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)  # room for a cut


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(params=["in-process", "engine-host"])
def serve(
    request: pytest.FixtureRequest, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[OtlpReceiver], ThreadedServer]]:
    """Starts a traced gateway whose model `tiny` is the local engine: in the gateway's process, or in an engine host
    the gateway reaches over its Unix socket (as each worker of `unigate serve --workers N` does)."""
    backend = tiny_local_backend(checkpoint, tmp_path / "cache")
    routing = parse_routing({"models": [{"id": "tiny", "deployments": [{"type": "local", "name": NAME}]}]}, source="t")
    host: ThreadedEngineHost | None = None
    settings = make_settings(data_dir=tmp_path / "data")
    if request.param == "engine-host":
        host = ThreadedEngineHost(backend, tmp_path / "engine.sock")
        host.__enter__()  # (left below)
        settings = settings.with_engine_sockets({NAME: str(tmp_path / "engine.sock")})
    servers: list[ThreadedServer] = []

    def start(receiver: OtlpReceiver) -> ThreadedServer:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        provided = {} if host is not None else {NAME: backend}  # (with the host: the gateway builds its client)
        app = create_app(settings, access=RecordingAccess(master_key=MASTER), routing=routing, backends=provided)
        servers.append(ThreadedServer(app).start())
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
        if host is not None:
            host.stop()  # (closes the backend)
        else:
            asyncio.run(backend.aclose())


def trace_of(spans: list[Any], request_id: str) -> tuple[Any, dict[str, Any], Any]:
    """The request's root span, its spans by name, and its (one) attempt span."""
    [root] = [s for s in spans if s.name == "chat tiny" and span_attributes(s)["unigate.request_id"] == request_id]
    named = {s.name: s for s in spans if s.trace_id == root.trace_id}
    [attempt] = [s for s in named.values() if s.name == f"unigate.attempt {NAME}"]
    return root, named, attempt


def assert_stages(spans: list[Any], request_id: str, reached: tuple[str, ...] = STAGES) -> None:
    root, named, attempt = trace_of(spans, request_id)
    stages = [named[name] for name in reached]
    assert not set(STAGES) - set(reached) & set(named)  # a stage not reached has no span
    assert all(s.parent_span_id == attempt.span_id for s in stages)
    for earlier, later in itertools.pairwise(stages):  # one after the other: queue, prefill, decode
        assert earlier.end_time_unix_nano == later.start_time_unix_nano
    for span in stages:
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_local_request_has_its_queue_prefill_and_decode_under_its_attempt(
    serve: Callable[[OtlpReceiver], ThreadedServer], receiver: OtlpReceiver
) -> None:
    server = serve(receiver)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        answered = client.post("/v1/chat/completions", json=CHAT)
        with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as streamed:
            body = streamed.read()
    assert answered.status_code == 200 and streamed.status_code == 200 and b"[DONE]" in body
    assert "x_unigate_engine_stages" not in answered.json()  # the engine's report went to the trace only
    request_ids = [answered.headers["x-request-id"], streamed.headers["x-request-id"]]
    wait_for(lambda: len([s for s in receiver.spans() if s.name == "unigate.engine.decode"]) == 2, "both traces")
    spans = receiver.spans()
    for request_id in request_ids:
        assert_stages(spans, request_id)


def test_a_stream_the_client_cut_shows_the_stages_it_reached(
    serve: Callable[[OtlpReceiver], ThreadedServer], receiver: OtlpReceiver
) -> None:
    server = serve(receiver)
    long = {**CHAT, "stream": True, "max_tokens": 3000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=long) as streamed:
            lines = streamed.iter_lines()
            for _ in range(3):  # the role chunk and two tokens: the engine is decoding
                next(lines)
            request_id = streamed.headers["x-request-id"]
    wait_for(lambda: any(s.name == "chat tiny" for s in receiver.spans()), "the cut request's trace")
    wait_for(lambda: any(s.name == "unigate.engine.prefill" for s in receiver.spans()), "the cut request's stages")
    assert_stages(receiver.spans(), request_id, reached=STAGES[:2])  # decode never finished
