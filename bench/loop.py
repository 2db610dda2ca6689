"""The event loop the bench runs on: uvloop when installed (libuv's poll loop, the lowest per-read latency
measured for the client), else asyncio's own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def loop_name() -> str:
    """`uvloop` or `asyncio`: the loop `run` uses, recorded with the run's environment."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"
