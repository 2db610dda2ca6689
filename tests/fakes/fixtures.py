"""Pytest fixtures around the fakes: a fresh fake upstream per test, and real uvicorn servers for apps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fakes.server import ThreadedServer
from fakes.upstream import FakeUpstream

__all__ = ["fake_upstream", "fake_upstream_factory", "gateway_server"]


@pytest.fixture
def fake_upstream() -> Iterator[FakeUpstream]:
    """A running fake upstream (normal behaviour); `.behave(...)` / `.queue(...)` to make it misbehave."""
    with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture
def fake_upstream_factory() -> Iterator[Callable[[], FakeUpstream]]:
    """Start as many extra upstreams as a test needs (e.g. two deployments of one model)."""
    started: list[FakeUpstream] = []

    def start() -> FakeUpstream:
        upstream = FakeUpstream().start()
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        upstream.stop()


@pytest.fixture
def gateway_server() -> Iterator[Callable[..., ThreadedServer]]:
    """`server = gateway_server(app)`: serves `app` under uvicorn on a free loopback port until the test ends."""
    started: list[ThreadedServer] = []

    def start(app: Any, **config: Any) -> ThreadedServer:
        server = ThreadedServer(app, **config).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
