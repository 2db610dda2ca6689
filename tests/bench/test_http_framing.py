"""The response parser fed read by read: however the bytes are split, the same head and body come out, each body
byte carrying the time of the read that delivered it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.http_framing import ChunkedDecoder, FramingError, ResponseParser, parse_head

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _feed_all(parser: ResponseParser, reads: list[bytes]) -> list[tuple[float, bytes]]:
    for index, data in enumerate(reads):
        parser.feed(float(index), data)
    return parser.pieces


@given(
    parts=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_chunked_bodies_survive_any_split_and_keep_each_reads_time(parts: list[bytes], cuts: list[int]) -> None:
    wire = HEAD + _chunked(parts)
    reads = _split(wire, cuts)
    parser = ResponseParser(max_pending=10**6)
    pieces = _feed_all(parser, reads)
    assert parser.is_complete and parser.is_framed and not parser.has_extra_bytes
    assert b"".join(body for _, body in pieces) == b"".join(parts)
    # Every body byte is stamped with the read it came in (a read's index is its time here).
    is_body = [False] * len(HEAD)
    for part in parts:
        is_body += [False] * len(b"%x\r\n" % len(part)) + [True] * len(part) + [False, False]
    is_body += [False] * 5
    expected, position = [], 0
    for index, data in enumerate(reads):
        body = bytes(b for offset, b in enumerate(data) if is_body[position + offset])
        position += len(data)
        if body:
            expected.append((float(index), body))
    assert pieces == expected


def test_an_event_split_across_reads_is_stamped_with_the_read_that_completes_it() -> None:
    parser = ResponseParser()
    event = b'data: {"x": 1}\n\n'
    wire = HEAD + _chunked([event])
    cut = len(HEAD) + 10
    assert parser.feed(1.0, wire[:cut]) is True  # the head is in: the reader is due
    assert parser.feed(2.0, wire[cut:]) is True  # the body ended
    assert parser.pieces[-1][0] == 2.0
    assert b"".join(body for _, body in parser.pieces) == event


def test_the_reader_is_woken_only_for_the_head_the_end_or_a_full_batch() -> None:
    parser = ResponseParser(max_pending=3)
    assert parser.feed(0.0, HEAD) is True
    chunk = b"3\r\nabc\r\n"
    assert [parser.feed(float(i), chunk) for i in range(1, 4)] == [False, False, True]
    parser.pieces.clear()
    assert parser.feed(4.0, b"0\r\n\r\n") is True and parser.is_complete


def test_content_length_close_delimited_and_bodyless_responses() -> None:
    parser = ResponseParser()
    parser.feed(0.0, b"HTTP/1.1 429 Too Many\r\ncontent-length: 5\r\n\r\nab")
    parser.feed(1.0, b"cdeXX")
    assert parser.is_complete and parser.has_extra_bytes  # bytes past the body: do not reuse the connection
    assert [body for _, body in parser.pieces] == [b"ab", b"cde"]

    parser = ResponseParser()
    parser.feed(0.0, b"HTTP/1.0 200 OK\r\n\r\nhello")
    assert parser.headers["connection"] == "close" and not parser.is_complete
    parser.feed_eof()
    assert parser.is_complete and not parser.is_framed

    parser = ResponseParser()
    parser.feed(0.0, b"HTTP/1.1 204 No Content\r\n\r\n")
    assert parser.is_complete and parser.is_framed and not parser.pieces


def test_interim_responses_trailers_and_extensions() -> None:
    parser = ResponseParser()
    parser.feed(0.0, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n")
    parser.feed(1.0, b"\r\n4;ext=1\r\nabcd\r\n0\r\nx-trailer: 1\r\n\r\n")
    assert parser.status_code == 200 and parser.is_complete
    assert b"".join(body for _, body in parser.pieces) == b"abcd"


@pytest.mark.parametrize(
    "wire",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        HEAD + b"zz\r\n",
        HEAD + b"3\r\nabcdef\r\n",
    ],
)
def test_malformed_responses_raise_framing_errors(wire: bytes) -> None:
    with pytest.raises(FramingError):
        ResponseParser().feed(0.0, wire)


def test_a_connection_closing_mid_response_is_an_error() -> None:
    parser = ResponseParser()
    parser.feed(0.0, HEAD + b"5\r\nab")
    with pytest.raises(FramingError, match="before the response ended"):
        parser.feed_eof()
    with pytest.raises(FramingError, match="inside the response head"):
        ResponseParser().feed_eof()


def test_parse_head_joins_repeated_headers() -> None:
    status, headers = parse_head(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2")
    assert status == 200 and headers == {"x-a": "1, 2"}


def test_chunked_decoder_keeps_bytes_after_the_last_chunk() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"2\r\nhi\r\n0\r\n\r\nHTTP/1.1") == b"hi"
    assert decoder.is_done and decoder.extra == b"HTTP/1.1"
