"""A local deployment whose engine runs in another process of this host: `EngineClient`.

With `unigate serve --workers N` the engine runs once, in its own process (`gateway.engine_host`, on a Unix
socket), and each worker's local deployment is this client of it, over the engine protocol
(`backends.engine_protocol`, the only module the two sides share). It keeps the local backend's contract
(`backends.local.LocalBackend`): the caller's tenancy reaches the engine; the same chunks and responses (the clamp
report under `MAX_TOKENS_CLAMPED_KEY`, `usage` with cached tokens, a stream's counts so far when it is closed
early, and the stages its request reached in the engine, for the trace), the same errors (503 `engine_loading` with
`Retry-After` while the model loads, 400s naming the field), `health_state()`, `output_limits()`,
`count_prompt_tokens()` and `stats()`.

Each call has a connection of its own (taken from a pool of idle ones, `max_connections` open at most) and gives
it back when the call ends. A call that ends early (a stream closed, a caller gone) sends `abort` and closes its
connection: the engine aborts the request, freeing its KV blocks within a step. (One connection per call measured
as fast as one multiplexed connection per worker, with less to go wrong: benchmarks/RESULTS.md.)

State, stats and the context length are the engine's answers to `get_state`, asked every `poll_interval_s` by a
background task (the capabilities that report them do no I/O). An engine process that does not answer (stopped,
or being restarted by the parent) makes requests fail at once with 503 `engine_error` (type `service_unavailable`,
never a cooldown) and a `Retry-After`, never hang, and `health_state()` say `down`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from backends.base import Endpoint, EngineStageTimes, HealthState, Json, MeteredStream, OutputLimits, Tenancy
from backends.config import LocalModelOptions
from backends.engine_protocol import (
    Abort,
    AddRequest,
    CountTokens,
    Failed,
    Finished,
    FrameDecoder,
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
)
from backends.local_mapping import NATIVE_ENDPOINTS
from gateway.errors import EngineError, GatewayError, UnavailableError

__all__ = ["EngineClient", "EngineClientConfig"]

# Retry-After of a 503 when the engine process does not answer: a restart takes seconds (the model then loads,
# and requests get `engine_loading` from the engine itself).
ENGINE_DOWN_RETRY_AFTER_S = 5
_STATE_TIMEOUT_S = 5.0
_READ_BYTES = 2**16


@dataclass(frozen=True, slots=True)
class EngineClientConfig:
    """One `type: local` deployment served by an engine process. `model` and `clamp_max_tokens` are the
    deployment's, as the engine process applies them (`backends.local.LocalBackendConfig`); of the model's options
    the client reads the output limit."""

    name: str  # the deployment's stable name (metrics, cooldowns, leases)
    socket_path: str  # the engine host's Unix socket
    model: LocalModelOptions = field(default_factory=LocalModelOptions)
    clamp_max_tokens: bool = True
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # one read from the engine (a long prefill sends nothing meanwhile)
    max_connections: int = 100  # open to the engine at once; a call beyond waits for one to end
    poll_interval_s: float = 1.0


class _Channel:
    """One connection to the engine host, carrying one call at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.received: deque[WorkerMessage | HostMessage] = deque()

    def is_usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()  # (at EOF: the host closed it, or died)

    def send(self, message: WorkerMessage) -> None:
        self.writer.write(encode(message))

    async def receive(self, timeout_s: float) -> WorkerMessage | HostMessage | None:
        """The next message; None when the host closed the connection. Whatever one read brings is decoded at
        once (a busy worker finds several chunks waiting), and a read waits `timeout_s` at most."""
        while not self.received:
            async with asyncio.timeout(timeout_s):
                data = await self.reader.read(_READ_BYTES)
            if not data:
                if self.decoder.is_partial:
                    raise TruncatedFrameError("the engine host closed the connection in the middle of a frame")
                return None
            self.received.extend(self.decoder.feed(data))
        return self.received.popleft()

    def abort(self, call_id: int) -> None:
        """End a call before its end: the host cancels it, and the connection, which may still bring its
        messages, is closed."""
        if not self.writer.is_closing():
            self.send(Abort(call_id))
            self.writer.close()


class EngineClient:
    """A local deployment served by the engine process listening on `config.socket_path`."""

    def __init__(self, config: EngineClientConfig) -> None:
        self.name = config.name
        self.config = config
        self._ids = itertools.count()
        self._idle: list[_Channel] = []
        self._slots = asyncio.Semaphore(config.max_connections)
        self._poller: asyncio.Task[None] | None = None
        self._state: HealthState = "loading"  # until the engine first answers
        self._engine: State | None = None  # its last answer to `get_state`
        self._context_length: int | None = None
        with contextlib.suppress(RuntimeError):  # built outside an event loop: polling starts at first use
            self._start()

    def _start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name=f"unigate-engine-{self.name}")

    # -- Backend protocol ---------------------------------------------------------------------------------------

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in NATIVE_ENDPOINTS

    async def send(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> Json:
        reply = await self._call(lambda call_id: AddRequest.of(call_id, request_id, endpoint, False, body, tenancy))
        if not isinstance(reply, Response):
            raise self._malformed(f"a {reply.KIND!r} message for a request")
        return reply.body

    def stream(
        self,
        endpoint: Endpoint,
        body: Json,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Tenancy | None = None,
    ) -> MeteredStream:
        """The engine's chunks; the stream reports the engine's counts as of the last chunk (`usage_so_far`), which
        is what a stream closed before its usage chunk used, and the stages its request reached (`engine_stages`)."""
        counts: list[int] = []
        stages: list[int] = []
        request = AddRequest.of(next(self._ids), request_id, endpoint, True, body, tenancy)
        chunks = self._stream(request, counts, stages)
        return MeteredStream(chunks, lambda: _usage(counts), lambda: _stages(stages))

    async def _stream(self, request: AddRequest, counts: list[int], stages: list[int]) -> AsyncGenerator[Json, None]:
        call_id = request.call_id
        async with self._slots:
            channel = await self._acquire()
            is_ended = is_started = False
            try:
                channel.send(request)
                while True:
                    message = await self._read(channel, call_id, self.config.read_timeout_s, is_started=is_started)
                    is_started = True
                    if isinstance(message, Output):
                        counts[:] = message.counts or counts
                        if message.stages:
                            stages[:] = message.stages
                        yield message.chunk
                    elif isinstance(message, Finished | Failed):
                        is_ended = True
                        if isinstance(message, Failed):
                            raise message.to_error()
                        return
                    else:
                        raise self._malformed(f"a {message.KIND!r} message in a stream")
            finally:
                if is_ended:
                    self._release(channel)
                else:
                    channel.abort(call_id)

    async def count_prompt_tokens(self, body: Json) -> int:
        """The engine's exact count (its tokenizer and chat template), as `LocalBackend.count_prompt_tokens`."""
        reply = await self._call(lambda call_id: CountTokens(call_id, body))
        if not isinstance(reply, TokenCount):
            raise self._malformed(f"a {reply.KIND!r} message for a count")
        return reply.num_tokens

    def output_limits(self) -> OutputLimits:
        """The engine's context length (None until it answered with its model loaded), the deployment's clamp and
        default output limit."""
        return OutputLimits(
            self._context_length, self.config.clamp_max_tokens, self.config.model.default_max_tokens or None
        )

    async def check_health(self) -> bool:
        return self.health_state() == "up"

    def health_state(self) -> HealthState:
        """The engine's own state at its last answer (`loading`, `up`, `restarting`, `down`), or `down` when its
        process did not answer."""
        return self._state

    def stats(self) -> dict[str, Any]:
        """The engine's stats at its last answer (at most `poll_interval_s` old), with this deployment's name and
        the engine process's `pid`; `loaded: false` while its model loads or its process does not answer."""
        engine = self._engine
        # An answer that says `down` keeps its stats (e.g. the load failed: `load_failed`, `load_error` come
        # through); a process that did not answer has none (`_engine` was dropped with its last answer).
        if engine is None:
            return {"name": self.name, "loaded": False, "load_failed": False, "state": self._state}
        return {"loaded": False, **engine.stats, "name": self.name, "state": self._state, "pid": engine.pid}

    async def aclose(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        idle, self._idle = self._idle, []
        for channel in idle:
            channel.writer.close()

    # -- the engine process -------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask the engine for its state, stats and context length now."""
        try:
            reply: HostMessage | None = await self._call(GetState, _STATE_TIMEOUT_S)
        except GatewayError:
            reply = None
        if not isinstance(reply, State):
            self._state, self._engine = "down", None  # its last answer is stale: nothing of it is reported
            return
        self._engine = reply
        self._state = reply.state
        if reply.context_length is not None:
            self._context_length = reply.context_length

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.poll_interval_s)

    async def _call(self, build: Callable[[int], WorkerMessage], timeout_s: float | None = None) -> HostMessage:
        """One call answered by one message; a `failed` one raises its error."""
        call_id = next(self._ids)
        async with self._slots:
            channel = await self._acquire()
            is_ended = False
            try:
                channel.send(build(call_id))
                reply = await self._read(channel, call_id, timeout_s or self.config.read_timeout_s, is_started=False)
                is_ended = True
            finally:
                if is_ended:
                    self._release(channel)
                else:
                    channel.abort(call_id)
        if isinstance(reply, Failed):
            raise reply.to_error()
        return reply

    async def _acquire(self) -> _Channel:
        self._start()
        while self._idle:
            channel = self._idle.pop()
            if channel.is_usable():
                return channel
            channel.writer.close()
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.config.socket_path)
        except (OSError, TimeoutError) as exc:
            raise self._unreachable(exc) from None
        return _Channel(reader, writer)

    def _release(self, channel: _Channel) -> None:
        if channel.is_usable():
            self._idle.append(channel)
        else:
            channel.writer.close()

    async def _read(self, channel: _Channel, call_id: int, timeout_s: float, *, is_started: bool) -> HostMessage:
        """The call's next message. The process gone (or silent for `timeout_s`) is a 503: before the call's first
        message as a process that does not answer, after it as a stream cut off."""
        try:
            message = await channel.receive(timeout_s)
        except (ConnectionError, TimeoutError, TruncatedFrameError) as exc:
            raise self._cut_off(exc) if is_started else self._unreachable(exc) from None
        except ProtocolError as exc:
            raise self._malformed(str(exc)) from None
        if message is None:
            raise self._cut_off() if is_started else self._unreachable(ConnectionError())
        if isinstance(message, AddRequest | Abort | CountTokens | GetState) or message.call_id != call_id:
            raise self._malformed(f"a {message.KIND!r} message for call {message.call_id} during call {call_id}")
        return message

    def _malformed(self, what: str) -> EngineError:
        return EngineError(
            f"The engine process answered something that is not of the engine protocol: {what}.", status_code=502
        )

    def _unreachable(self, exc: BaseException) -> UnavailableError:
        self._state, self._engine = "down", None
        what = "did not answer in time" if isinstance(exc, TimeoutError) else "is not running"
        return UnavailableError(
            f"The engine process of deployment {self.name!r} {what} (it stopped, or it is being restarted). "
            f"Retry in {ENGINE_DOWN_RETRY_AFTER_S} s.",
            code="engine_error",
            headers={"retry-after": str(ENGINE_DOWN_RETRY_AFTER_S)},
        )

    def _cut_off(self, exc: BaseException | None = None) -> UnavailableError:
        if not isinstance(exc, TimeoutError):
            self._state, self._engine = "down", None
        return UnavailableError(
            f"The engine process of deployment {self.name!r} stopped in the middle of the stream; the output above "
            "is incomplete. Retry the request.",
            code="engine_error",
            headers={"retry-after": str(ENGINE_DOWN_RETRY_AFTER_S)},
        )


def _stages(stages: list[int]) -> EngineStageTimes | None:
    """The engine's `[queued, scheduled, first token, finished]` (None before it sent any)."""
    if not stages:
        return None
    queued, scheduled, first_token, finished = stages
    return queued, scheduled, first_token, finished


def _usage(counts: list[int]) -> Json | None:
    """The usage object of the engine's `[prompt, cached, generated]` counts (None before it sent any)."""
    if not counts:
        return None
    num_prompt, num_cached, num_generated = counts
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_generated,
        "total_tokens": num_prompt + num_generated,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }
