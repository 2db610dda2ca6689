"""`CommandPipe` over a real Redis, and over a server that never answers (the pipe's own deadline, since its
connection has no socket timeout)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import NoScriptError, RedisError

from auth.redis_client import connect
from auth.resp_pipe import CommandPipe


@pytest.fixture
async def silent_url() -> AsyncIterator[str]:
    """A server that accepts connections and reads what it is sent, but never answers."""

    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    for writer in writers:
        writer.close()
    server.close()
    await server.wait_closed()


async def test_a_batch_gets_its_replies_in_order_and_an_error_reply_fails_only_its_command(redis_url: str) -> None:
    client = connect(redis_url)
    pipe = CommandPipe(client)
    try:
        replies = await asyncio.gather(
            pipe.execute("SET", "k", 7),
            pipe.evalsha("0" * 40, 0),
            pipe.execute("INCRBY", "k", 5),
            return_exceptions=True,
        )
        assert replies[0] == b"OK" and replies[2] == 12  # raw replies: no redis-py response callbacks
        assert isinstance(replies[1], NoScriptError)
        assert await pipe.execute("GET", "k") == b"12"
    finally:
        await pipe.aclose()
        await client.aclose()


async def test_a_server_that_never_answers_fails_the_batch_within_the_timeout(silent_url: str) -> None:
    client = connect(silent_url, timeout_s=0.3)
    pipe = CommandPipe(client)
    try:
        for _ in range(2):  # each batch reconnects: the connect, its handshake and the write all under the deadline
            started = time.monotonic()
            with pytest.raises((TimeoutError, RedisError, OSError)):
                await asyncio.gather(pipe.execute("PING"), pipe.execute("PING"))
            assert time.monotonic() - started < 2.0
    finally:
        await pipe.aclose()
        await client.aclose()
