"""The measuring transport against scripted raw servers on loopback: keep-alive, a server that closes idle
connections, `Connection: close`, timeouts, refused and broken connections, and streams cut at awkward places."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from bench.client import BenchClient
from bench.http_stream import ConnectError, StreamBrokenError, StreamPool, StreamTimeoutError
from bench.workload import BenchRequest

Script = list[tuple[float, bytes]]  # (seconds to wait, bytes to write); b"" = close the connection


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _content(text: str) -> bytes:
    return _event({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
OK_BODY = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


class ScriptedServer:
    """Answers the n-th request (over all connections) with `scripts(n)`; counts connections."""

    def __init__(self, scripts: Callable[[int], Script]) -> None:
        self.scripts = scripts
        self.num_connections = 0
        self.num_requests = 0
        self._server: asyncio.Server | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await reader.readexactly(length)
                script = self.scripts(self.num_requests)
                self.num_requests += 1
                for delay_s, data in script:
                    await asyncio.sleep(delay_s)
                    if not data:
                        writer.close()
                        return
                    writer.write(data)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()


async def _get(pool: StreamPool) -> bytes:
    async with pool.request(pool.encode("GET", "/models")) as response:
        return await response.read()


@pytest.fixture
async def pool_factory() -> AsyncIterator[Callable[..., StreamPool]]:
    pools: list[StreamPool] = []

    def make(base_url: str, **kwargs: object) -> StreamPool:
        pools.append(StreamPool(base_url, **kwargs))  # type: ignore[arg-type]
        return pools[-1]

    yield make
    for pool in pools:
        await pool.aclose()


async def test_keep_alive_reuses_one_connection(pool_factory: Callable[..., StreamPool]) -> None:
    async with ScriptedServer(lambda n: [(0, OK_BODY)]) as server:
        pool = pool_factory(server.base_url)
        assert [await _get(pool) for _ in range(3)] == [b"ok"] * 3
    assert server.num_connections == 1


async def test_a_connection_the_server_closed_while_idle_is_replaced_transparently(
    pool_factory: Callable[..., StreamPool],
) -> None:
    # The server answers, then closes the connection a moment later (an idle keep-alive timeout) with no header
    # saying so; the next request finds it closed and goes out again on a new connection.
    async with ScriptedServer(lambda n: [(0, OK_BODY), (0.01, b"")]) as server:
        pool = pool_factory(server.base_url)
        assert await _get(pool) == b"ok"
        await asyncio.sleep(0.05)
        assert await _get(pool) == b"ok"
    assert server.num_connections == 2


async def test_connection_close_is_honoured(pool_factory: Callable[..., StreamPool]) -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    async with ScriptedServer(lambda n: [(0, closing)]) as server:
        pool = pool_factory(server.base_url)
        assert [await _get(pool) for _ in range(2)] == [b"ok"] * 2
    assert server.num_connections == 2


async def test_silence_times_out_and_a_dropped_stream_is_broken(pool_factory: Callable[..., StreamPool]) -> None:
    async with ScriptedServer(lambda n: [(0, STREAM_HEAD), (5, b"")]) as server:
        with pytest.raises(StreamTimeoutError):
            await _get(pool_factory(server.base_url, timeout_s=0.2))
    async with ScriptedServer(lambda n: [(0, STREAM_HEAD + b"5\r\nab"), (0, b"")]) as server:
        with pytest.raises(StreamBrokenError):
            await _get(pool_factory(server.base_url))
    async with ScriptedServer(lambda n: [(0, b"")]) as server:
        with pytest.raises(StreamBrokenError, match="without a response"):
            await _get(pool_factory(server.base_url))


async def test_nothing_listening_is_a_connect_error(pool_factory: Callable[..., StreamPool]) -> None:
    async with ScriptedServer(lambda n: []) as server:
        url = server.base_url
    with pytest.raises(ConnectError):
        await _get(pool_factory(url))


async def test_pieces_keep_the_order_and_time_of_their_reads(pool_factory: Callable[..., StreamPool]) -> None:
    script = [(0, STREAM_HEAD + _chunk(b"one ")), (0.03, _chunk(b"two ")), (0.03, _chunk(b"three") + b"0\r\n\r\n")]
    async with ScriptedServer(lambda n: script) as server:
        pool = pool_factory(server.base_url, max_pending_reads=1)
        async with pool.request(pool.encode("GET", "/stream")) as response:
            pieces = []
            while reads := await response.body_reads():
                pieces += reads
    assert b"".join(body for _, body in pieces) == b"one two three"
    times = [at for at, _ in pieces]
    # Three writes 30 ms apart are three reads (unless a stall on a busy machine let two pile up in the socket).
    assert response.sent_at < times[0] and times == sorted(set(times)) and 2 <= len(times) <= 3


async def test_bench_client_reads_streams_cut_at_awkward_places() -> None:
    usage = _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}})
    first, second, third = _content("a"), _content("b"), _content("c")
    crlf = third.replace(b"\n", b"\r\n")  # some servers end SSE lines with CRLF
    body = _chunk(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})) + _chunk(first[:9])
    script = [
        (0, STREAM_HEAD + body),
        (0.02, _chunk(first[9:]) + _chunk(second[:4])),
        (0.02, _chunk(second[4:] + crlf) + _chunk(usage + b"data: [DONE]\n\n") + b"0\r\n\r\n"),
    ]
    async with ScriptedServer(lambda n: script) as server:
        async with BenchClient(server.base_url, "", "fake-model") as client:
            results = [await client.send(BenchRequest([{"role": "user", "content": "hi"}], 3)) for _ in range(2)]
    assert server.num_connections == 1  # the stream ended cleanly, so the connection was reused
    for result in results:
        assert result.is_ok, result.error_code
        assert result.num_output_tokens == 3 and result.is_usage_reported and len(result.itl_s) == 2
        assert result.ttft_s is not None and 0 < result.ttft_s <= result.e2e_s
        assert result.itl_s[1] == 0.0  # "b" and "c" were completed by the same read


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_tls_with_a_verified_certificate(tmp_path: Path, pool_factory: Callable[..., StreamPool]) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    scripted = ScriptedServer(lambda n: [(0, OK_BODY)])
    server = await asyncio.start_server(scripted._serve, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    try:
        trusting = pool_factory(f"https://localhost:{port}/v1", ssl_context=ssl.create_default_context(cafile=cert))
        assert await _get(trusting) == b"ok"
        with pytest.raises(ConnectError):  # the default trust store does not know a self-signed certificate
            await _get(pool_factory(f"https://localhost:{port}/v1"))
    finally:
        server.close()
