"""The engine protocol: what a worker (`backends.engine_client`) and the engine host (`gateway.engine_host`) say to
each other over the host's owner-only Unix socket. Not a public API: both ends ship together.

A message is one frame: a 4-byte big-endian length, then that many bytes of JSON, an array naming the message and
the call it belongs to (an id the worker picks, unique on its connection), then the message's fields in order:

    worker → host                                       host → worker
    ["add", id, request_id, endpoint, is_stream, body,  ["output", id, chunk, counts,  a stream's next chunk
     tenant, weight, priority]                            stages]
    ["abort", id]                                       ["finished", id]               a stream's end
    ["count_tokens", id, body]                          ["response", id, body]         an unstreamed call's answer
    ["get_state", id]                                   ["num_tokens", id, n]
                                                        ["state", id, pid, state, context_length, stats]
                                                        ["failed", id, error, status, code, message, param, headers]

An `add` says whose call it is (the caller's tenant, weight and priority class: `backends.base.Tenancy`). Each
`output` carries the engine's counts so far, `[prompt, cached, generated]` tokens (`[]` before it counted any): what
a stream the worker closes early used (`backends.base.ReportsStreamUsage`). An `output` whose chunk follows news of
when the request reached each stage in the engine carries them all, `[queued, scheduled, first token, finished]` (wall
clock ns, 0 for a stage not reached: `backends.base.ReportsEngineStages`), the others `[]`: a stream cut short knows
the stages it reached. An unstreamed answer has them in its body (`backends.base.ENGINE_STAGES_KEY`).

Every call ends with one of finished / response / num_tokens / state / failed, except an aborted one, which ends
with nothing (the worker has forgotten it); a closed connection aborts every call still running on it. `failed`
carries the gateway error the host's backend raised (class, status, code, message, param, headers), rebuilt on the
worker's side as the same error. A frame over `max_bytes`, a truncated one or one that is not a message of this
table is a `ProtocolError`: the reader closes the connection.
"""

from __future__ import annotations

import asyncio
import struct
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, cast

import orjson

from backends.base import HealthState, Json, Priority, Tenancy
from gateway.errors import EngineError, GatewayError

__all__ = [
    "MAX_FRAME_BYTES",
    "Abort",
    "AddRequest",
    "CountTokens",
    "Failed",
    "Finished",
    "FrameDecoder",
    "GetState",
    "HostMessage",
    "Output",
    "ProtocolError",
    "Response",
    "State",
    "TokenCount",
    "TruncatedFrameError",
    "WorkerMessage",
    "decode",
    "encode",
    "read_message",
]

MAX_FRAME_BYTES = 256 * 2**20  # a request body, or an unstreamed response with logprobs, fits many times over
_HEADER = struct.Struct(">I")
_HEALTH_STATES = frozenset(typing.get_args(HealthState))
_PRIORITIES = frozenset(typing.get_args(Priority))
_NOBODY = Tenancy()


class ProtocolError(Exception):
    """A frame that is not a message of the engine protocol (or over the size limit)."""


class TruncatedFrameError(ProtocolError):
    """The connection closed in the middle of a frame."""


class _Message:
    __slots__ = ()
    KIND: ClassVar[str]
    _WIRE: ClassVar[tuple[frozenset[type], ...]]  # the JSON types each field accepts, from its annotation

    def to_wire(self) -> list[Any]:
        names: tuple[str, ...] = self.__slots__  # a dataclass's fields, in order
        return [self.KIND, *map(self.__getattribute__, names)]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _KINDS[cls.KIND] = cls


_KINDS: dict[str, type[_Message]] = {}


@dataclass(frozen=True, slots=True)
class AddRequest(_Message):
    KIND = "add"
    call_id: int
    request_id: str  # the gateway's request id (logs, the engine's sequence names)
    endpoint: str  # "chat/completions" or "completions"; another is answered `failed` (404)
    is_stream: bool
    body: Json
    tenant: str = ""  # whose share of the engine serves it (`backends.base.Tenancy`)
    weight: float = 1.0  # > 0
    priority: str = "normal"  # "high", "normal" or "low"

    @classmethod
    def of(
        cls, call_id: int, request_id: str, endpoint: str, is_stream: bool, body: Json, tenancy: Tenancy | None
    ) -> AddRequest:
        tenancy = tenancy or _NOBODY
        return cls(
            call_id, request_id, endpoint, is_stream, body, tenancy.tenant, float(tenancy.weight), tenancy.priority
        )

    @property
    def tenancy(self) -> Tenancy:
        return Tenancy(self.tenant, self.weight, cast(Priority, self.priority))


@dataclass(frozen=True, slots=True)
class Abort(_Message):
    KIND = "abort"
    call_id: int


@dataclass(frozen=True, slots=True)
class CountTokens(_Message):
    KIND = "count_tokens"
    call_id: int
    body: Json  # a chat-completions body


@dataclass(frozen=True, slots=True)
class GetState(_Message):
    KIND = "get_state"
    call_id: int


@dataclass(frozen=True, slots=True)
class Output(_Message):
    KIND = "output"
    call_id: int
    chunk: Json
    counts: list[int] = field(default_factory=list)  # the engine's [prompt, cached, generated] tokens so far
    stages: list[int] = field(default_factory=list)  # [queued, scheduled, first token, finished] ns, when news


@dataclass(frozen=True, slots=True)
class Finished(_Message):
    KIND = "finished"
    call_id: int


@dataclass(frozen=True, slots=True)
class Response(_Message):
    KIND = "response"
    call_id: int
    body: Json


@dataclass(frozen=True, slots=True)
class TokenCount(_Message):
    KIND = "num_tokens"
    call_id: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class State(_Message):
    KIND = "state"
    call_id: int
    pid: int
    state: HealthState
    context_length: int | None  # None while the model loads
    stats: Json  # `LocalBackend.stats()`


@dataclass(frozen=True, slots=True)
class Failed(_Message):
    KIND = "failed"
    call_id: int
    error: str  # the class name of the gateway error (`gateway.errors`)
    status: int
    code: str
    message: str
    param: str | None
    headers: dict[str, str]

    @classmethod
    def of(cls, call_id: int, error: GatewayError) -> Failed:
        headers = error.headers
        return cls(call_id, type(error).__name__, error.status_code, error.code, error.message, error.param, headers)

    def to_error(self) -> GatewayError:
        """The same gateway error: class (an unknown one is an `EngineError`), status, code, message, param and
        headers (e.g. `Retry-After`)."""
        kind = _ERRORS.get(self.error, EngineError)
        headers = {str(name): str(value) for name, value in self.headers.items()}
        return kind(self.message, code=self.code, param=self.param, headers=headers, status_code=self.status)


WorkerMessage = AddRequest | Abort | CountTokens | GetState
HostMessage = Output | Finished | Response | TokenCount | State | Failed


def _error_classes(root: type[GatewayError]) -> dict[str, type[GatewayError]]:
    found = {root.__name__: root}
    for sub in root.__subclasses__():
        if sub.__module__ == root.__module__:  # the tree of `gateway.errors`, nothing registered elsewhere
            found.update(_error_classes(sub))
    return found


_ERRORS = _error_classes(GatewayError)


def _wire_types(cls: type[_Message]) -> tuple[frozenset[type], ...]:
    hints = typing.get_type_hints(cls, globals())
    accepted = []
    for each in fields(cast(Any, cls)):
        hint = hints[each.name]
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if typing.get_origin(hint) is typing.Literal:  # checked by `decode` (a closed set of strings)
            options = (str,)
        accepted.append(frozenset(typing.get_origin(option) or option for option in options))
    return tuple(accepted)


for _cls in _KINDS.values():
    _cls._WIRE = _wire_types(_cls)


def encode(message: WorkerMessage | HostMessage) -> bytes:
    """The frame of `message`: its length, then its JSON."""
    payload = orjson.dumps(message.to_wire())
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes | bytearray) -> WorkerMessage | HostMessage:
    """The message in a frame's payload; `ProtocolError` when it is not one of the table."""
    try:
        items = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"a frame that is not JSON ({exc})") from None
    if not isinstance(items, list) or not items or not isinstance(items[0], str) or items[0] not in _KINDS:
        raise ProtocolError("a frame that names no message of the engine protocol")
    cls, values = _KINDS[items[0]], items[1:]
    # Exact types (JSON gives exactly int, str, dict, ...; so a bool is no int here), checked at C speed.
    if len(values) != len(cls._WIRE) or not all(map(frozenset.__contains__, cls._WIRE, map(type, values))):
        raise ProtocolError(f"a {cls.KIND!r} message with fields of the wrong number or type")
    message: WorkerMessage | HostMessage = cast(Any, cls)(*values)
    if isinstance(message, State) and message.state not in _HEALTH_STATES:
        raise ProtocolError(f"a state message with the unknown state {message.state!r}")
    if isinstance(message, AddRequest) and (message.priority not in _PRIORITIES or not message.weight > 0):
        raise ProtocolError(f"an add message with the priority {message.priority!r} and weight {message.weight!r}")
    if isinstance(message, Output) and message.counts and (len(message.counts) != 3 or not _are_ints(message.counts)):
        raise ProtocolError(f"an output message with the counts {message.counts!r}")
    if isinstance(message, Output) and message.stages and (len(message.stages) != 4 or not _are_ints(message.stages)):
        raise ProtocolError(f"an output message with the stages {message.stages!r}")
    return message


def _are_ints(values: list[Any]) -> bool:
    return all(type(value) is int for value in values)


class FrameDecoder:
    """Messages from a byte stream read in pieces of any size (as `backends.sse.SSEDecoder` reads SSE): `feed`
    returns the messages the data completes; a frame announcing more than `max_bytes` is a `ProtocolError`."""

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    @property
    def is_partial(self) -> bool:
        """Whether part of a frame waits for the rest (a stream that ends now is truncated)."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> list[WorkerMessage | HostMessage]:
        buffer = self._buffer
        buffer += data
        messages = []
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            if size > self.max_bytes:
                raise ProtocolError(f"a frame of {size} bytes, over the limit of {self.max_bytes}")
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            messages.append(decode(buffer[start + _HEADER.size : end]))  # (a copy: the buffer stays resizable)
            start = end
        del buffer[:start]
        return messages


async def read_message(
    reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES
) -> WorkerMessage | HostMessage | None:
    """The next message on the connection; None when the peer closed it between two frames. A frame announcing
    more than `max_bytes` is refused before anything of it is read."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise TruncatedFrameError("the connection closed in the middle of a frame's length") from None
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise ProtocolError(f"a frame of {size} bytes, over the limit of {max_bytes}")
    try:
        payload = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise TruncatedFrameError(f"the connection closed after {len(exc.partial)} of a frame's {size} bytes") from None
    return decode(payload)
