"""A client that leaves while its body is read, against real servers over raw sockets: the production gateway on a
loopback port (every route that reads a body), where nobody is answered, the request counts as
`client_disconnected` (status 499 in the request metrics), one line is logged, no traceback; and a worker that
leaves the engine host on its Unix socket, which is one line too."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.app import MASTER
from fakes.checkpoints import tiny_llama_checkpoint
from fakes.engine_host import ThreadedEngineHost, tiny_local_backend
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream
from starlette.applications import Starlette

from backends.engine_protocol import AddRequest, encode
from gateway.metrics import GatewayMetrics
from gateway.server import build_app
from gateway.settings import Settings

DECLARED_BYTES = 100_000
PARTIAL_BODY = b'{"model": "gpt-test", "messages": [{"role": "user", "content": "' + b"x" * 1000


class Records(logging.Handler):
    """Every record of our loggers and uvicorn's (its "Exception in ASGI application" goes to `uvicorn.error`)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def assert_one_quiet_line(self) -> None:
        assert not [r for r in self.records if r.exc_info or r.levelno >= logging.ERROR]
        assert not [r for r in self.records if "unhandled error" in r.getMessage()]
        [line] = [r for r in self.records if "disconnected" in r.getMessage()]
        assert line.levelno in (logging.INFO, logging.WARNING) and "\n" not in line.getMessage()


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("unigate", "uvicorn.error")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    yield handler
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def app(redis_url: str, tmp_path: Path, fake_upstream: FakeUpstream) -> Starlette:
    """The production app (Redis-backed keys, admin API, console) with one fake upstream."""
    routing = tmp_path / "unigate.yaml"
    deployment = {"type": "openai", "base_url": fake_upstream.base_url, "api_key": "sk-upstream"}
    routing.write_text(yaml.safe_dump({"models": [{"id": "gpt-test", "deployments": [deployment]}]}))
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        master_key=MASTER,
        engine={"enabled": False},  # type: ignore[arg-type]
        config=routing,
        redis_url=redis_url,
        data_dir=tmp_path / "data",
        health_probe_interval_s=0,
    )
    return build_app(settings)


def send_half_body(sock: socket.socket, path: str) -> None:
    """A POST that declares `DECLARED_BYTES` of body, sends part of it, and closes the connection."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {MASTER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {DECLARED_BYTES}\r\n\r\n"
    )
    with sock:
        sock.sendall(head.encode() + PARTIAL_BODY)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def samples(metrics: GatewayMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    }


@pytest.mark.parametrize(
    "path",
    ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/admin/keys", "/ui/api/login"],
)
def test_a_client_gone_mid_body_is_counted_apart_and_logged_in_one_line(
    app: Starlette, gateway_server: Callable[..., ThreadedServer], records: Records, path: str
) -> None:
    server = gateway_server(app, log_config=None)
    metrics: GatewayMetrics = app.state.metrics
    send_half_body(socket.create_connection(("127.0.0.1", server.port), timeout=20), path)
    wait_for(lambda: samples(metrics, "unigate_requests_total"), "the request to be counted")
    [(labels, count)] = samples(metrics, "unigate_requests_total").items()
    assert (dict(labels)["status"], count) == ("499", 1.0)
    assert samples(metrics, "unigate_errors_total") == {(("code", "client_disconnected"),): 1.0}
    records.assert_one_quiet_line()


def _tiny_checkpoint(directory: Path) -> Path:
    return tiny_llama_checkpoint(directory, max_position_embeddings=4096)  # room for a stream still running at the cut


@pytest.mark.parametrize("cut", ["mid-message", "mid-stream"])
def test_a_worker_gone_mid_request_is_no_engine_host_error(tmp_path: Path, records: Records, cut: str) -> None:
    """The engine host's side: a worker that leaves in the middle of a message, or of a stream (its process killed:
    no `abort`), is one quiet line, and its call is aborted."""
    backend = tiny_local_backend(_tiny_checkpoint(tmp_path / "tiny"), tmp_path / "cache")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000, "ignore_eos": True}
    frame = encode(AddRequest(1, "req-1", "chat/completions", True, body))
    socket_path = tmp_path / "engine.sock"
    with ThreadedEngineHost(backend, socket_path) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(str(socket_path))
            if cut == "mid-message":
                sock.sendall(frame[: len(frame) // 2])
            else:
                sock.sendall(frame)
                assert sock.recv(4)  # the stream has started (after the model loaded)
        wait_for(lambda: [r for r in records.records if "disconnected" in r.getMessage() or r.exc_info], "a log line")
        wait_for(lambda: server.host.num_calls() == 0, "the call to end")
        server.stop()  # every call has ended: nothing more can be logged
    records.assert_one_quiet_line()
