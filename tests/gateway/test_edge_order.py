"""The order of the edge checks docs/api-limits.md states, against a real uvicorn over raw sockets: a declared
Content-Length over the limit is 413 before the key is looked at (no body is sent here, so none can be read); any
other body waits until the key is verified (401 without a byte of it sent)."""

from __future__ import annotations

import re
import select
import socket
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from fakes.app import MASTER, build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

MAX_BODY_BYTES = 16 * 2**20  # the default, as a reader of the docs has it
BAD_KEY = "sk-ug-not-a-key"


@pytest.fixture
def server(fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]) -> ThreadedServer:
    return gateway_server(build_app(single_model(fake_upstream), max_body_bytes=MAX_BODY_BYTES))


def head(key: str, framing: str) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: gateway", f"Authorization: Bearer {key}", framing]
    return ("\r\n".join([*lines, "content-type: application/json", "", ""])).encode()


def answer(server: ThreadedServer, request: bytes) -> tuple[int, Any]:
    """Send `request` (a head, perhaps a partial body; stopping once the server answers) and read the one response;
    the socket's timeout bounds a server that waits for the rest of the body instead of answering."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        for start in range(0, len(request), 2**16):
            if select.select([sock], [], [], 0)[0]:
                break  # answered already
            try:
                sock.sendall(request[start : start + 2**16])
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        response_head, _, body = received.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: (\d+)", response_head)
        assert length is not None, response_head
        while len(body) < int(length.group(1)):
            body += sock.recv(65536)
    return int(response_head.split(b" ", 2)[1]), orjson.loads(body)


def code(body: Any) -> str:
    return str(body["error"]["code"])


def test_a_declared_body_over_the_limit_is_413_before_the_key(server: ThreadedServer) -> None:
    status, body = answer(server, head(BAD_KEY, f"Content-Length: {17 * 2**20}"))  # 17 MiB declared, none sent
    assert (status, code(body)) == (413, "body_too_large")


def test_any_other_body_waits_for_the_key(server: ThreadedServer) -> None:
    status, body = answer(server, head(BAD_KEY, "Content-Length: 1000"))  # not a byte of the body sent
    assert (status, code(body)) == (401, "invalid_api_key")
    # a chunked body declares no size: the key is checked before the first chunk is read
    status, body = answer(server, head(BAD_KEY, "Transfer-Encoding: chunked"))
    assert (status, code(body)) == (401, "invalid_api_key")


def test_a_valid_key_then_the_body_limit_while_reading(server: ThreadedServer) -> None:
    chunk = b"x" * 2**20
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17))  # 17 MiB, no Content-Length
    status, body = answer(server, head(MASTER, "Transfer-Encoding: chunked") + chunks + b"0\r\n\r\n")
    assert (status, code(body)) == (413, "body_too_large")
