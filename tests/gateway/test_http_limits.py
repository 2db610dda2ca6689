"""The request head and path, against a real uvicorn on a loopback port, over raw sockets: oversized heads get 431
(and never reach the app), a CR/LF encoded in the path is served with a safe note, and `/admin/keys/` is answered
in place instead of redirecting to whatever Host the client sent."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fakes.app import AUTH, CHAT, MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from auth.redis_client import connect
from auth.store import KeyStore
from gateway.app import create_app
from gateway.http_limits import MAX_HEADERS, protocol_options
from gateway.middleware import normalize_path
from gateway.routes.admin import admin_routes
from gateway.server import uvicorn_config
from gateway.settings import Settings

MAX_HEADER_BYTES = 64 * 1024


@pytest.fixture
def server(fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]) -> ThreadedServer:
    return gateway_server(build_app(single_model(fake_upstream)), **protocol_options(MAX_HEADER_BYTES))


def exchange(server: ThreadedServer, head: bytes, *, chunk: int = 64 * 1024) -> bytes:
    """Send `head` (stopping early once the server answers) and read until the server closes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        for start in range(0, len(head), chunk):
            if select.select([sock], [], [], 0)[0]:
                break  # answered already: stop sending
            try:
                sock.sendall(head[start : start + chunk])
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
        return received


def request(path: str = "/health/live", headers: list[tuple[str, str]] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: gateway", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Big", "a" * (MAX_HEADER_BYTES + 1))],  # one header over the byte limit
        [(f"X-H{i}", "v" * 600) for i in range(120)],  # many medium headers over the byte limit
        [(f"X-H{i}", "v") for i in range(MAX_HEADERS + 1)],  # one header over the count limit
        [(f"X-H{i}", "v") for i in range(20_000)],  # the report's 20,000 headers
        [("X-Big", "a" * (8 * 1024 * 1024))],  # the report's 8 MB header
    ],
    ids=["one-big", "many-medium", "count+1", "20000", "8MB"],
)
def test_oversized_heads_get_431_and_never_reach_the_app(
    server: ThreadedServer, fake_upstream: FakeUpstream, headers: list[tuple[str, str]]
) -> None:
    response = exchange(server, request("/v1/models", headers))
    assert status_of(response) == 431, response[:200]
    assert b'"code":"headers_too_large"' in response
    assert httpx.get(f"{server.url}/health/live").status_code == 200  # the server still serves


def test_heads_within_the_limits_are_served(server: ThreadedServer) -> None:
    headers = [(f"X-H{i}", "v" * 100) for i in range(MAX_HEADERS - 5)]
    assert status_of(exchange(server, request("/health/live", headers))) == 200
    response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={**AUTH, "x-pad": "p" * 30_000})
    assert response.status_code == 200


def test_large_bodies_are_not_counted_as_head_bytes(server: ThreadedServer, fake_upstream: FakeUpstream) -> None:
    """A body's last segment arriving in one read (here 200 KB, more than twice the head limit) once counted as the
    next request's head: 431 after the request had been served. Each try sends the body's end in one write."""
    body = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 600_000}]})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
        f"Authorization: Bearer {MASTER}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    served = len(fake_upstream.requests)
    for _ in range(8):
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
            sock.sendall(head + body[:-200_000])
            time.sleep(0.05)  # the server reads that part before the rest arrives
            sock.sendall(body[-200_000:])
            reader = sock.makefile("rb")
            assert reader.readline().startswith(b"HTTP/1.1 200"), reader.read()[:300]
    assert len(fake_upstream.requests) == served + 8


def test_a_keep_alive_connection_is_limited_per_request(server: ThreadedServer) -> None:
    small = request("/health/live").replace(b"Connection: close", b"Connection: keep-alive")
    big = request("/health/live", [(f"X-H{i}", "v") for i in range(MAX_HEADERS + 1)])
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        reader = sock.makefile("rb")
        for _ in range(3):
            sock.sendall(small)
            assert reader.readline().startswith(b"HTTP/1.1 200")
            length = 0
            while (line := reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
        sock.sendall(big)
        assert reader.readline().startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("path", ["/foo%0d%0aSet-Cookie:%20x=1", "/v1/v1/models%0d%0aX:%20y", "/%0a%0d%00%ff"])
def test_cr_lf_in_the_path_is_answered_with_an_encoded_note(server: ThreadedServer, path: str) -> None:
    response = exchange(server, request(path, [("Authorization", f"Bearer {MASTER}")]))
    status = status_of(response)
    assert status in (200, 404), response[:300]
    head = response.split(b"\r\n\r\n", 1)[0]
    assert b"\nset-cookie" not in head.lower() and b"\nX: y" not in head  # no injected header line
    [note] = [line for line in head.split(b"\r\n") if line.lower().startswith(b"x-unigate-path-normalized")]
    assert b"%0D%0A" in note or b"%0A" in note


def test_uvicorn_config_applies_the_limits(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, data_dir=tmp_path, max_header_bytes=100_000)  # type: ignore[call-arg]
    config = uvicorn_config(settings)
    assert config.http == "gateway.http_limits:LimitedHttpToolsProtocol"
    assert config.h11_max_incomplete_event_size == 100_000


def test_h11_fallback_also_answers_431(
    fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> None:
    options = {"http": "gateway.http_limits:LimitedH11Protocol", "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
    server = gateway_server(build_app(single_model(fake_upstream)), **options)
    assert status_of(exchange(server, request("/health/live"))) == 200
    for headers in ([("X-Big", "a" * (MAX_HEADER_BYTES + 1))], [(f"X-H{i}", "v") for i in range(MAX_HEADERS + 1)]):
        assert status_of(exchange(server, request("/health/live", headers))) == 431


# --- /admin/keys/ ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/chat/completions/", "/v1/chat/completions"),
        ("/v1/v1/models/", "/v1/models"),
        ("/", "/"),
        ("//", "/"),
    ],
)
def test_trailing_slashes_are_normalized_away(path: str, served: str) -> None:
    assert normalize_path(path) == served


@pytest.mark.parametrize(
    "path",
    ["/admin/keys/", "/admin/keys//", "/admin/usage/", "/metrics/", "/health/live/", "/ui/", "/ui/api/session/"],
)
def test_paths_outside_v1_are_never_rewritten(path: str) -> None:
    """docs/gateway.md, path tolerance: /health/*, /metrics, /admin/* and /ui/* are never rewritten (a trailing
    slash there is not dropped either)."""
    assert normalize_path(path) == path


@pytest.fixture
def admin_server(redis_url: str, tmp_path: Path, gateway_server: Callable[..., ThreadedServer]) -> Iterator[Any]:
    settings = Settings(_env_file=None, master_key=MASTER, data_dir=tmp_path, engine={"enabled": False})  # type: ignore[arg-type,call-arg]
    redis = connect(redis_url)  # used (and closed) on the server's event loop
    app = create_app(settings, extra_routes=admin_routes(), on_shutdown=[redis.aclose])
    app.state.key_store = KeyStore(redis)
    app.state.master_key = MASTER
    yield gateway_server(app, **protocol_options(MAX_HEADER_BYTES))


@pytest.mark.parametrize("path", ["/admin/keys/", "/admin/keys//", "/admin/usage/", "/metrics/", "/health/live/"])
def test_a_trailing_slash_outside_v1_is_a_404_never_a_rewrite_or_a_redirect(
    admin_server: ThreadedServer, path: str
) -> None:
    """Never rewritten (no x-unigate-path-normalized) and never redirected (a redirect would point at whatever Host
    the client sent): a 404 `not_found` in the envelope, for a caller with or without a key."""
    evil = {"host": "attacker.example"}
    for headers in (evil, {**evil, **AUTH}):
        response = httpx.get(f"{admin_server.url}{path}", headers=headers, follow_redirects=False)
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "not_found"
        assert "location" not in response.headers and "x-unigate-path-normalized" not in response.headers
        assert "attacker" not in response.text
    served = httpx.get(f"{admin_server.url}{path.rstrip('/')}", headers=AUTH, follow_redirects=False)
    assert served.status_code == 200 and "x-unigate-path-normalized" not in served.headers
