"""The hot path's own RESP encoder sends exactly the bytes redis-py would, and refuses what redis-py refuses."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from auth.resp_pipe import encode_command


@pytest.mark.parametrize(
    "args",
    [
        ("EVALSHA", "0" * 40, 2, "ug:{k1}:rpm", "ug:{k1}:tpm", 1.5, -7, 10**15, b"\x00\xffbin", "ünïcode ✓"),
        ("SCRIPT", "LOAD", "return redis.call('TIME')"),
        ("PING",),
    ],
)
def test_same_bytes_as_redis_py(args: tuple[object, ...]) -> None:
    expected = b"".join(bytes(part) for part in Connection().pack_command(*args))
    assert encode_command(args) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [None, True, object()])
def test_refuses_values_redis_py_refuses(bad: object) -> None:
    with pytest.raises(DataError):
        encode_command(("SET", "k", bad))  # type: ignore[arg-type]
