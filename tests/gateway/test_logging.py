"""The console log format cannot be forged: control characters in a record's message, its arguments, its request
id or its exception text are written as visible escapes, so one record never starts a line of its own making."""

from __future__ import annotations

import io
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from fakes.app import build_app, single_model
from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

from gateway.logging import configure_logging

_CONFIGURED = ("unigate", "uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture
def console_log() -> Iterator[io.StringIO]:
    """`configure_logging(format="console")` writing into a buffer; the loggers are put back afterwards."""
    saved = [
        (logger, logger.handlers, logger.level, logger.propagate, logger.disabled)
        for logger in map(logging.getLogger, _CONFIGURED)
    ]
    configure_logging("info", "console")
    buffer = io.StringIO()
    [handler] = logging.getLogger("unigate").handlers
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    yield buffer
    for logger, handlers, level, propagate, disabled in saved:
        logger.handlers, logger.propagate, logger.disabled = handlers, propagate, disabled
        logger.setLevel(level)


def test_control_characters_in_message_args_and_request_id_stay_on_one_line(console_log: io.StringIO) -> None:
    record = logging.makeLogRecord(
        {
            "name": "unigate.access",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "GET %s\r\n2024-01-01 00:00:00,000 INFO    unigate.access: forged %d",
            "args": ("/x\n\x1b[2J\\n", 200),
            "request_id": "req\nFAKE",
        }
    )
    line = logging.getLogger("unigate").handlers[0].format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(
        "unigate.access: GET /x\\n\\x1b[2J\\\\n\\r\\n2024-01-01 00:00:00,000 INFO    unigate.access: forged 200 "
        "[req\\nFAKE]"
    )


def test_plain_records_are_written_as_before(console_log: io.StringIO) -> None:
    record = logging.makeLogRecord(
        {
            "name": "unigate.access",
            "levelno": logging.INFO,
            "levelname": "INFO",
            "msg": "GET %s %d",
            "args": ("/v1/models", 200),
        }
    )
    line = logging.getLogger("unigate").handlers[0].format(record)
    assert line.endswith("INFO    unigate.access: GET /v1/models 200")


def test_exception_text_keeps_its_lines_but_none_can_pose_as_a_record(console_log: io.StringIO) -> None:
    try:
        raise ValueError("bad value\n2024-01-01 00:00:00,000 INFO    unigate.access: forged\x1b[0m")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.makeLogRecord(
        {"name": "unigate.errors", "levelno": logging.ERROR, "levelname": "ERROR", "msg": "unhandled error"}
    )
    record.exc_info = exc_info
    first, *rest = logging.getLogger("unigate").handlers[0].format(record).split("\n")
    assert first.endswith("ERROR   unigate.errors: unhandled error")
    assert rest and all(line.startswith("  | ") for line in rest)  # a traceback, each line marked as one
    assert (
        "  | ValueError: bad value" in rest
        and "  | 2024-01-01 00:00:00,000 INFO    unigate.access: forged\\x1b[0m" in rest
    )


def test_a_newline_in_a_requested_path_forges_no_log_line(
    console_log: io.StringIO, fake_upstream: FakeUpstream, gateway_server: Callable[..., ThreadedServer]
) -> None:
    server = gateway_server(build_app(single_model(fake_upstream)), log_config=None)
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(b"GET /x%0aFAKE%0d%1b[31mred HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    assert answer.startswith(b"HTTP/1.1 404 ")
    deadline = time.monotonic() + 10  # the access line is written once the answer went out
    while "unigate.access" not in console_log.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = console_log.getvalue().splitlines()
    [access] = [line for line in lines if "unigate.access" in line]
    assert "/x\\nFAKE\\r\\x1b[31mred 404" in access
    assert not [line for line in lines if line.startswith("FAKE") or "\x1b" in line]
