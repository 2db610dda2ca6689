"""The engine protocol's framing and messages: every message survives a round trip, read whole (`read_message`) or
in pieces split anywhere (`FrameDecoder`); a truncated frame, an oversize one and garbage are each a
`ProtocolError` (never another exception, never a read past the limit); a gateway error crosses as the same
error."""

from __future__ import annotations

import asyncio
import itertools
import struct
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.engine_protocol import (
    Abort,
    AddRequest,
    CountTokens,
    Failed,
    Finished,
    FrameDecoder,
    GetState,
    Output,
    ProtocolError,
    Response,
    State,
    TokenCount,
    TruncatedFrameError,
    decode,
    encode,
    read_message,
)
from gateway import errors
from gateway.errors import EngineError, EngineLoadingError, GatewayError, InvalidRequestError

call_ids = st.integers(min_value=0, max_value=2**63 - 1)
texts = st.text(max_size=20)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=10,
)
bodies = st.dictionaries(texts, json_values, max_size=4)
messages = st.one_of(
    st.builds(
        AddRequest,
        call_ids,
        texts,
        st.sampled_from(["chat/completions", "completions"]),
        st.booleans(),
        bodies,
        texts,
        st.floats(min_value=1e-6, max_value=1e6),
        st.sampled_from(["high", "normal", "low"]),
    ),
    st.builds(Abort, call_ids),
    st.builds(CountTokens, call_ids, bodies),
    st.builds(GetState, call_ids),
    st.builds(Output, call_ids, bodies, st.just([]) | st.lists(st.integers(0, 2**31), min_size=3, max_size=3)),
    st.builds(Finished, call_ids),
    st.builds(Response, call_ids, bodies),
    st.builds(TokenCount, call_ids, st.integers(0, 2**31)),
    st.builds(
        State,
        call_ids,
        st.integers(1, 2**22),
        st.sampled_from(["up", "down", "loading", "restarting"]),
        st.none() | st.integers(1, 2**20),
        bodies,
    ),
    st.builds(
        Failed,
        call_ids,
        texts,
        st.integers(400, 599),
        texts,
        texts,
        st.none() | texts,
        st.dictionaries(texts, texts, max_size=2),
    ),
)

KINDS = ["add", "abort", "count_tokens", "get_state", "output", "finished", "response", "num_tokens", "state", "failed"]
near_messages = st.builds(lambda kind, rest: orjson.dumps([kind, *rest]), st.sampled_from(KINDS), st.lists(json_values))


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


@given(messages)
def test_every_message_survives_a_round_trip(message: Any) -> None:
    frame = encode(message)
    assert struct.unpack(">I", frame[:4]) == (len(frame) - 4,)
    assert decode(frame[4:]) == message


@settings(max_examples=50)
@given(st.lists(messages, min_size=1, max_size=4))
async def test_frames_read_back_in_order_then_none_at_a_clean_end(sent: list[Any]) -> None:
    reader = reader_of(b"".join(encode(message) for message in sent))
    assert [await read_message(reader) for _ in sent] == sent
    assert await read_message(reader) is None


@settings(max_examples=50)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(st.integers(1, 64), min_size=1, max_size=20))
def test_the_decoder_reads_frames_split_anywhere(sent: list[Any], sizes: list[int]) -> None:
    frames = [encode(message) for message in sent]
    stream, boundaries = b"".join(frames), set(itertools.accumulate(map(len, frames), initial=0))
    decoder, received, start = FrameDecoder(), [], 0
    for size in itertools.cycle(sizes):
        if start >= len(stream):
            break
        received += decoder.feed(stream[start : start + size])
        start = min(start + size, len(stream))
        assert decoder.is_partial == (start not in boundaries)  # (a stream ending here would be truncated)
    assert received == sent and not decoder.is_partial


def test_the_decoder_refuses_an_oversize_frame_from_its_length_alone() -> None:
    decoder = FrameDecoder(max_bytes=1024)
    assert decoder.feed(encode(Finished(1))) == [Finished(1)]
    with pytest.raises(ProtocolError, match="over the limit of 1024"):
        decoder.feed(struct.pack(">I", 1025))


@given(st.binary(max_size=64) | near_messages)
def test_the_decoder_turns_garbage_into_protocol_errors(payload: bytes) -> None:
    try:
        FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)
    except ProtocolError:
        pass


async def test_every_truncation_of_a_frame_is_a_truncated_frame() -> None:
    frame = encode(Output(7, {"choices": [{"delta": {"content": "hi"}}]}))
    for end in range(1, len(frame)):
        with pytest.raises(TruncatedFrameError):
            await read_message(reader_of(frame[:end]))


async def test_an_oversize_frame_is_refused_before_its_body_is_read() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", 1025))  # and no body: reading one would wait forever
    with pytest.raises(ProtocolError, match="over the limit of 1024"):
        await asyncio.wait_for(read_message(reader, max_bytes=1024), 5)
    exact = encode(Finished(1))
    assert await read_message(reader_of(exact), max_bytes=len(exact) - 4) == Finished(1)


@given(st.binary(max_size=64) | near_messages)
def test_garbage_is_a_protocol_error_or_a_message(payload: bytes) -> None:
    try:
        message = decode(payload)
    except ProtocolError:
        return
    assert decode(encode(message)[4:]) == message


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"{}",
        b"[]",
        b'["add"]',
        b'["nope", 1]',
        b'["abort", "1"]',
        b'["abort", true]',
        b'["abort", 1, 2]',
        b'["output", 1, []]',
        b'["add", 1, "r", "chat/completions", 1, {}]',
        b'["state", 1, 2, "sleeping", null, {}]',
        b'["num_tokens", 1, 2.5]',
        b"\xff\xfe",
    ],
)
def test_malformed_messages_are_protocol_errors(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(payload)


ERROR_CLASSES = [getattr(errors, name) for name in errors.__all__ if name[0].isupper()]


@pytest.mark.parametrize("kind", ERROR_CLASSES, ids=lambda kind: kind.__name__)
def test_a_gateway_error_crosses_as_the_same_error(kind: type[GatewayError]) -> None:
    sent = kind("what went wrong", param="temperature", headers={"retry-after": "5"})
    received = decode(encode(Failed.of(3, sent))[4:])
    assert isinstance(received, Failed)
    error = received.to_error()
    assert type(error) is kind
    assert (error.status_code, error.type, error.code, error.message, error.param, error.headers) == (
        sent.status_code,
        sent.type,
        sent.code,
        sent.message,
        sent.param,
        sent.headers,
    )


def test_an_error_keeps_its_own_status_and_code() -> None:
    too_long = InvalidRequestError("too long", code="context_length_exceeded")
    assert Failed.of(1, too_long).to_error().code == "context_length_exceeded"
    unavailable = EngineError("busy", status_code=503).to_dict()["error"]
    error = Failed.of(1, EngineError("busy", status_code=503)).to_error()
    assert (error.status_code, error.type) == (503, unavailable["type"]) == (503, "service_unavailable")
    loading = Failed.of(1, EngineLoadingError("loading", headers={"retry-after": "5"})).to_error()
    assert isinstance(loading, EngineLoadingError) and loading.headers == {"retry-after": "5"}


def test_an_unknown_error_class_is_an_engine_error() -> None:
    error = Failed(1, "SomethingNew", 500, "new_code", "boom", None, {}).to_error()
    assert type(error) is EngineError and (error.status_code, error.code) == (500, "new_code")


@pytest.mark.parametrize(
    "fields",
    [
        ["add", 1, "r", "chat/completions", True, {}, "key-a", 1.0, "urgent"],  # no such priority
        ["add", 1, "r", "chat/completions", True, {}, "key-a", 0.0, "normal"],  # a weight must be positive
        ["add", 1, "r", "chat/completions", True, {}, "key-a", -2.0, "high"],
        ["add", 1, "r", "chat/completions", True, {}, "key-a", 1, "normal"],  # a weight is a float on the wire
        ["output", 1, {}, [1, 2], []],  # counts are [prompt, cached, generated]
        ["output", 1, {}, [1, 2, "3"], []],
        ["output", 1, {}, [1, 2, 3.0], []],
        ["output", 1, {}, [], [1, 2, 3]],  # stages are [queued, scheduled, first token, finished]
        ["output", 1, {}, [], [1, 2, 3, 4.0]],
        ["output", 1, {}, [1, 2, 3]],  # an output always has its stages, if only []
    ],
)
def test_a_tenancy_counts_or_stages_out_of_their_range_is_a_protocol_error(fields: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        decode(orjson.dumps(fields))


def test_an_add_carries_its_tenancy_and_an_output_its_counts_and_stages() -> None:
    from backends.base import Tenancy

    sent = AddRequest.of(3, "r", "completions", True, {}, Tenancy("team-a", 3, "high"))
    received = decode(encode(sent)[4:])
    assert isinstance(received, AddRequest) and received.tenancy == Tenancy("team-a", 3.0, "high")
    assert AddRequest.of(3, "r", "completions", True, {}, None).tenancy == Tenancy()
    assert decode(encode(Output(3, {}, [4028, 16, 5]))[4:]) == Output(3, {}, [4028, 16, 5])
    stages = [1_765_000_000_000_000_000, 1_765_000_000_100_000_000, 1_765_000_000_200_000_000, 0]
    assert decode(encode(Output(3, {}, [], stages))[4:]) == Output(3, {}, [], stages)
