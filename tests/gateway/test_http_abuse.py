"""Abuse of HTTP/1.1 framing, over raw sockets to a real uvicorn gateway: a chunked body's trailer or chunk-size
line that never ends is cut off at a bound (431, the connection closed) instead of being buffered after the answer,
with either protocol class and in `unigate engine serve`; protocol-level answers carry the console's security
headers. Each attack sends a fixed number of bytes (the bound and a bit) and then waits for the answer: a server
that went on reading would never answer."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn
from fakes.app import CHAT, MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from gateway.engine_host import http as engine_server
from gateway.http_limits import MAX_HEADERS
from gateway.security_headers import SECURITY_HEADERS
from gateway.settings import Settings

MAX_HEADER_BYTES = 64 * 1024
# Sent before waiting for the answer: past twice the bound (httptools cuts a line that never ends there, h11 at the
# bound) plus the 16 KiB it may parse before counting.
ATTACK_BYTES = 2 * MAX_HEADER_BYTES + 32 * 1024
PROTOCOLS = ["LimitedHttpToolsProtocol", "LimitedH11Protocol"]

Response = tuple[int, dict[str, str], bytes]


@pytest.fixture(params=PROTOCOLS)
def server(
    request: pytest.FixtureRequest, fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> ThreadedServer:
    options = {"http": f"gateway.http_limits:{request.param}", "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
    return gateway_server(build_app(single_model(fake_upstream)), **options)


def chunked_head(*, has_key: bool = True, path: str = "/v1/chat/completions") -> bytes:
    """A keep-alive request head (an answer does not end the connection: the body's bytes are still read)."""
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json", "Transfer-Encoding: chunked"]
    lines += [f"Authorization: Bearer {MASTER}"] if has_key else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def read_response(reader: Any) -> Response:
    status = int(reader.readline().split(b" ")[1])
    headers: dict[str, str] = {}
    while (line := reader.readline()) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers.get("content-length", "0")))


def attack(server: ThreadedServer, start: bytes, filler: bytes, *, num_answers_first: int = 0) -> list[Response]:
    """Send `start` (and read the `num_answers_first` answers it gets at once), then `filler` in 4 KiB writes up to
    ATTACK_BYTES in all; then read the answers until the server closes (a server still reading would let the 20 s
    socket timeout fail the test)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        reader = sock.makefile("rb")
        sock.sendall(start)
        responses = [read_response(reader) for _ in range(num_answers_first)]
        num_sent, piece = len(start), filler * (4096 // len(filler))
        try:
            while num_sent < ATTACK_BYTES:
                sock.sendall(piece)
                num_sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed after answering: the answer is still to be read
        return responses + parse_responses(reader.read())


def read_to_end(sock: socket.socket) -> bytes:
    received = b""
    while data := sock.recv(65536):
        received += data
    return received


def parse_responses(raw: bytes) -> list[Response]:
    responses: list[Response] = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
        length = int(headers.get("content-length", "0"))
        responses.append((int(status_line.split(" ")[1]), headers, raw[:length]))
        raw = raw[length:]
    return responses


def assert_closed_with(responses: list[Response], status: int, code: str) -> dict[str, str]:
    """The last answer is `status` with the OpenAI envelope and `connection: close`; its headers."""
    assert responses, "no answer"
    last_status, headers, body = responses[-1]
    assert (last_status, orjson.loads(body)["error"]["code"]) == (status, code), responses
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    return headers


# --- trailers and chunk-size lines that never end ---------------------------------------------------------------


@pytest.mark.parametrize("has_key", [False, True], ids=["answered-401-first", "body-still-awaited"])
def test_a_trailer_line_that_never_ends_is_cut_off(
    server: ThreadedServer, fake_upstream: FakeUpstream, has_key: bool
) -> None:
    """The review's attack: after the last chunk, a trailer line that never ends. Without a key the 401 is sent
    first (as soon as the head is read), and the 431 follows; with one, the route still awaits the body and is told
    the client is gone: it never reaches the upstream."""
    start = chunked_head(has_key=has_key) + chunk(orjson.dumps(CHAT)) + b"0\r\nX-Trailer: "
    responses = attack(server, start, b"a", num_answers_first=0 if has_key else 1)
    assert_closed_with(responses, 431, "headers_too_large")
    assert [status for status, _, _ in responses[:-1]] == ([] if has_key else [401])
    assert fake_upstream.requests == []


@pytest.mark.parametrize(
    ("line", "filler"),
    [(b"5;ext=", b"a"), (b"5", b";e=v"), (b"", b"0")],
    ids=["one-long-extension", "many-extensions", "leading-zeros"],
)
def test_a_chunk_size_line_that_never_ends_is_cut_off(
    server: ThreadedServer, fake_upstream: FakeUpstream, line: bytes, filler: bytes
) -> None:
    start = chunked_head() + chunk(b'{"model": ') + line
    assert_closed_with(attack(server, start, filler), 431, "headers_too_large")
    assert fake_upstream.requests == []


def test_a_trailer_line_that_never_ends_in_one_write_is_cut_off(server: ThreadedServer) -> None:
    """The head, the body and the trailer's start arrive together, likely in one read: the bytes after the body are
    counted all the same."""
    start = chunked_head() + chunk(orjson.dumps(CHAT)) + b"0\r\nX-Trailer: "
    assert_closed_with(attack(server, start + b"a" * (ATTACK_BYTES - len(start)), b"a"), 431, "headers_too_large")


def test_trailer_fields_over_the_byte_limit_are_refused(server: ThreadedServer) -> None:
    """Complete trailer lines, each short, adding up past the bound: 431 like the same lines in a head."""
    start = chunked_head() + chunk(orjson.dumps(CHAT)) + b"0\r\n"
    assert_closed_with(attack(server, start, b"X-T: " + b"v" * 1017 + b"\r\n"), 431, "headers_too_large")


def test_trailer_fields_over_the_count_limit_are_refused(
    fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> None:
    """With httptools, trailer fields are also counted like headers (h11 keeps no count: it bounds their bytes)."""
    options = {"http": "gateway.http_limits:LimitedHttpToolsProtocol", "h11_max_incomplete_event_size": 65536}
    server = gateway_server(build_app(single_model(fake_upstream)), **options)
    trailers = b"".join(b"X-T%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    request = chunked_head() + chunk(orjson.dumps(CHAT)) + b"0\r\n" + trailers + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(request)
        responses = parse_responses(read_to_end(sock))
    assert_closed_with(responses, 431, "headers_too_large")
    assert fake_upstream.requests == []


# --- ordinary trailers still work -------------------------------------------------------------------------------


def test_a_small_trailer_is_served(server: ThreadedServer, fake_upstream: FakeUpstream) -> None:
    body = orjson.dumps(CHAT)
    request = chunked_head() + chunk(body[:10]) + chunk(body[10:]) + b"0\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(request)
        status, _, answer = read_response(sock.makefile("rb"))
    assert status == 200, answer
    assert [r.body["messages"] for r in fake_upstream.requests] == [CHAT["messages"]]


def test_a_keep_alive_connection_serves_two_requests_with_trailers(
    server: ThreadedServer, fake_upstream: FakeUpstream
) -> None:
    body = orjson.dumps(CHAT)
    request = chunked_head() + chunk(body) + b"0\r\nX-Checksum: " + b"c" * 2000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        reader = sock.makefile("rb")
        for _ in range(2):
            sock.sendall(request)
            status, headers, answer = read_response(reader)
            assert status == 200, answer
            assert headers.get("connection") != "close"
    assert len(fake_upstream.requests) == 2


async def echo_headers(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body, then answers the request's headers as the app sees them at that point."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = orjson.dumps(sorted(name.decode() for name, _ in scope["headers"]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_trailer_fields_do_not_become_request_headers(
    gateway_server: Callable[..., ThreadedServer], protocol: str
) -> None:
    """A trailer field is not merged into the headers the app reads (RFC 9110, section 6.5.1): after the body, a
    trailer could otherwise add an `authorization` or `x-csrf-token` the client did not send in the head."""
    options = {"lifespan": "off", "http": f"gateway.http_limits:{protocol}", "h11_max_incomplete_event_size": 65536}
    server = gateway_server(echo_headers, **options)
    request = chunked_head(has_key=False) + chunk(b"{}") + b"0\r\nX-Csrf-Token: forged\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(request)
        status, _, answer = read_response(sock.makefile("rb"))
    assert status == 200 and orjson.loads(answer) == ["content-type", "host", "transfer-encoding"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_response_under_way_is_cut_not_interrupted_by_the_answer(
    gateway_server: Callable[..., ThreadedServer], protocol: str
) -> None:
    """The app streams its answer without reading the body; the trailer that never ends then ends the connection
    without a 431 written into the middle of that stream, and the app is told its client has gone."""
    release, events = threading.Event(), []

    async def stream_at_once(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        while (message := await receive())["type"] == "http.request":
            pass  # the body is never complete: only a disconnect ends this
        events.append(message["type"])
        await asyncio.to_thread(release.wait, 20)
        await send({"type": "http.response.body", "body": b"last"})

    options = {"lifespan": "off", "http": f"gateway.http_limits:{protocol}", "h11_max_incomplete_event_size": 65536}
    server = gateway_server(stream_at_once, **options)
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        reader = sock.makefile("rb")
        sock.sendall(chunked_head() + chunk(b"{}") + b"0\r\nX-Trailer: ")
        received = b""
        while not received.endswith(b"first\r\n"):
            received += reader.readline()
        try:
            for _ in range(ATTACK_BYTES // 4096):
                sock.sendall(b"a" * 4096)
            received += reader.read()
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed with the attack's bytes unread: a reset
    release.set()
    assert received.startswith(b"HTTP/1.1 200") and b"431" not in received and b"last" not in received
    assert events == ["http.disconnect"]


# --- security headers on protocol-level answers -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (
            b"GET /ui/ HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\n\r\n",
            431,
            "headers_too_large",
        ),
        (b"GET /ui/ HTTP/1.1\r\nHost: gateway\r\nnot a header line\r\n\r\n", 400, "invalid_request"),
        (b"POST /ui/api/login HTTP/1.1\r\nHost: gateway\r\nContent-Length: ten\r\n\r\n", 400, "invalid_request"),
        (chunked_head(path="/ui/api/login") + b"zz\r\n", 400, "invalid_request"),
    ],
    ids=["431-head", "400-header-line", "400-content-length", "400-chunk-size"],
)
def test_protocol_level_answers_carry_the_security_headers(
    server: ThreadedServer, request_bytes: bytes, status: int, code: str
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(request_bytes)
        responses = parse_responses(read_to_end(sock))
    headers = assert_closed_with(responses, status, code)
    assert {name: headers.get(name) for name in SECURITY_HEADERS} == SECURITY_HEADERS


def test_the_trailer_431_carries_the_security_headers(server: ThreadedServer) -> None:
    start = chunked_head(has_key=False, path="/ui/api/login") + chunk(b"{}") + b"0\r\nX-Trailer: "
    headers = assert_closed_with(attack(server, start, b"a"), 431, "headers_too_large")
    assert {name: headers.get(name) for name in SECURITY_HEADERS} == SECURITY_HEADERS


# --- unigate engine serve -----------------------------------------------------------------------------------------


def test_engine_serve_cuts_off_a_trailer_that_never_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gateway_server: Callable[..., ThreadedServer]
) -> None:
    """`serve_engine` builds its uvicorn config with the same protocol options: taken from it (its run is the one
    part replaced), the engine app under that config answers the attack with 431."""
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: configs.append(self.config))
    settings = Settings(_env_file=None, data_dir=tmp_path, engine={"enabled": False}, max_header_bytes=MAX_HEADER_BYTES)  # type: ignore[call-arg, arg-type]
    engine_server.serve_engine(settings, api_key="sk-engine")
    [config] = configs
    assert config.http == "gateway.http_limits:LimitedHttpToolsProtocol"
    assert config.h11_max_incomplete_event_size == MAX_HEADER_BYTES
    server = gateway_server(config.app, http=config.http, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    start = chunked_head(has_key=False) + chunk(b"{}") + b"0\r\nX-Trailer: "
    responses = attack(server, start, b"a", num_answers_first=1)
    assert_closed_with(responses, 431, "headers_too_large")
    assert [status for status, _, _ in responses[:-1]] == [401]
