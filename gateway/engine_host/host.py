"""`EngineHost`: one local backend served to the workers over the engine protocol (`backends.engine_protocol`).

Each connection carries any number of calls, each a task of its own: an `add` streams the backend's chunks (or sends its
response), a `count_tokens` its exact count; `get_state` is answered at once, from memory. An `add` runs under the
caller's tenancy, and each output of a stream carries the engine's counts so far, for the worker to charge if its client
leaves, and any news of the stages its request reached in the engine, for the worker's trace. An `abort`, or the
connection closing, cancels the call's task, which closes the backend's stream: the engine aborts the request and frees
its KV blocks within a step. The backend's own calls are made with no pipeline in between (the worker's pipeline has
done auth, limits and routing), and a gateway error it raises goes back as `failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any, Protocol, cast

from backends.base import Endpoint, HealthState, Json, OutputLimits, ReportsEngineStages, ReportsStreamUsage, Tenancy
from backends.engine_protocol import (
    MAX_FRAME_BYTES,
    Abort,
    AddRequest,
    CountTokens,
    Failed,
    Finished,
    GetState,
    HostMessage,
    Output,
    ProtocolError,
    Response,
    State,
    TokenCount,
    TruncatedFrameError,
    WorkerMessage,
    encode,
    read_message,
)
from gateway.errors import EngineError, GatewayError, NotFoundError, UnavailableError
from gateway.logging import request_id_var

__all__ = ["EngineHost", "HostedBackend"]

logger = logging.getLogger("unigate.engine")

_ENDPOINTS = frozenset({"chat/completions", "completions"})


class HostedBackend(Protocol):
    """What the host serves: the local backend's calls and reports (`backends.local.LocalBackend`)."""

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> Json: ...

    def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> AsyncIterator[Json]: ...

    async def count_prompt_tokens(self, body: Json) -> int: ...

    def health_state(self) -> HealthState: ...

    def output_limits(self) -> OutputLimits: ...

    def stats(self) -> dict[str, Any]: ...


class _Connection:
    """One worker's connection: its calls in flight, and the writer they share."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.calls: dict[int, asyncio.Task[None]] = {}
        # Calls that ended because a write found the worker gone: the writer can notice before the reader's EOF
        # does, and the disconnection's one log line must count them either way.
        self.num_cut = 0

    def send(self, message: HostMessage) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(message))

    def abort(self, call_id: int) -> None:
        task = self.calls.pop(call_id, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        calls = list(self.calls.values())
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)  # each stream has closed: the engine aborted it
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class EngineHost:
    """Serves `backend` on a listening Unix socket until `shutdown`."""

    def __init__(self, backend: HostedBackend, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.backend = backend
        self.max_frame_bytes = max_frame_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._is_stopping = False

    async def start(self, sock: socket.socket) -> None:
        """Accept connections on `sock` (bound; listening from now on)."""
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting connections, let the calls in flight finish for `grace_s`, then cancel the rest."""
        self._is_stopping = True
        if self._server is not None:
            self._server.close()
        calls = [task for connection in self._connections for task in connection.calls.values()]
        if calls:
            await asyncio.wait(calls, timeout=grace_s)
        await asyncio.gather(*(connection.close() for connection in list(self._connections)))

    def num_calls(self) -> int:
        return sum(len(connection.calls) for connection in self._connections)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        self._connections.add(connection)
        try:
            while (message := await read_message(reader, self.max_frame_bytes)) is not None:
                self._dispatch(connection, message)
        except TruncatedFrameError:
            logger.info("a worker disconnected in the middle of a message to the engine")
        except ProtocolError as exc:
            logger.warning("closing a worker's connection to the engine: it sent %s", exc)
        except ConnectionError:
            pass  # reported below, with the calls it cut
        finally:
            if connection.calls or connection.num_cut:
                num_calls = len(connection.calls) + connection.num_cut
                logger.info("a worker disconnected from the engine; aborting its %d calls", num_calls)
            await connection.close()
            self._connections.discard(connection)

    def _dispatch(self, connection: _Connection, message: WorkerMessage | HostMessage) -> None:
        if isinstance(message, GetState):
            connection.send(self._state(message.call_id))
        elif isinstance(message, Abort):
            connection.abort(message.call_id)
        elif isinstance(message, AddRequest | CountTokens):
            if message.call_id in connection.calls:
                raise ProtocolError(f"a second call with the id {message.call_id} while the first runs")
            task = asyncio.get_running_loop().create_task(self._call(connection, message))
            connection.calls[message.call_id] = task
        else:
            raise ProtocolError(f"a message only the host sends ({type(message).__name__})")

    async def _call(self, connection: _Connection, message: AddRequest | CountTokens) -> None:
        """Run one call and send how it ended; an aborted call sends nothing more."""
        try:
            if self._is_stopping:
                raise UnavailableError("The engine is shutting down.", code="server_shutting_down")
            if isinstance(message, AddRequest):
                request_id_var.set(message.request_id)  # this task's own context: its log lines carry the id
                connection.send(await self._add(connection, message))
            else:
                connection.send(await self._count(message))
        except GatewayError as error:
            connection.send(Failed.of(message.call_id, error))
        except ConnectionError:
            connection.num_cut += 1  # the worker went away: its reader logs it and aborts the other calls
        except Exception as exc:
            logger.exception("the engine host failed a call")
            failure = EngineError(f"The engine host failed ({type(exc).__name__}).")
            connection.send(Failed.of(message.call_id, failure))
        finally:
            connection.calls.pop(message.call_id, None)

    async def _add(self, connection: _Connection, message: AddRequest) -> HostMessage:
        if message.endpoint not in _ENDPOINTS:
            raise NotFoundError(f"The engine serves no /{message.endpoint}.", code="not_found")
        endpoint = cast(Endpoint, message.endpoint)
        call_id, request_id, tenancy = message.call_id, message.request_id, message.tenancy
        if not message.is_stream:
            answer = await self.backend.send(endpoint, message.body, request_id=request_id, tenancy=tenancy)
            return Response(call_id, answer)
        stream = self.backend.stream(endpoint, message.body, request_id=request_id, tenancy=tenancy)
        meter = stream if isinstance(stream, ReportsStreamUsage) else None
        timer = stream if isinstance(stream, ReportsEngineStages) else None
        chunks = cast(AsyncGenerator[Json, None], stream)
        sent_stages: tuple[int, ...] | None = None
        try:
            async for chunk in chunks:
                # The counts so far go with each chunk: what the worker charges if its client leaves after it.
                counts = [] if meter is None else _counts(meter.usage_so_far())
                # The stages go with the first chunk after they changed (twice a request: at its first token, its end).
                stages = None if timer is None else timer.engine_stages()
                news = [] if stages is None or stages == sent_stages else list(stages)
                sent_stages = stages
                connection.send(Output(call_id, chunk, counts, news))
                await connection.writer.drain()  # a worker that reads slowly slows its streams, not our memory
        finally:
            await chunks.aclose()  # (cancelled: the engine aborts the request)
        return Finished(call_id)

    async def _count(self, message: CountTokens) -> HostMessage:
        return TokenCount(message.call_id, await self.backend.count_prompt_tokens(message.body))

    def _state(self, call_id: int) -> State:
        backend = self.backend
        context_length = backend.output_limits().context_length
        return State(call_id, os.getpid(), backend.health_state(), context_length, backend.stats())


def _counts(usage: Json | None) -> list[int]:
    """`[prompt, cached, generated]` tokens of a usage object (the local backend's), `[]` for none."""
    if usage is None:
        return []
    details = usage.get("prompt_tokens_details")
    counts = [
        usage.get("prompt_tokens"),
        details.get("cached_tokens", 0) if isinstance(details, dict) else 0,
        usage.get("completion_tokens"),
    ]
    ints = [count for count in counts if type(count) is int]
    return ints if len(ints) == 3 else []  # (never counts the protocol would refuse)
