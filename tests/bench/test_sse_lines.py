"""`bench.sse_lines.SSEDataLines`: the client's view of an OpenAI-style stream, as `unigate doctor` reads it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from bench.sse_lines import SSEDataLines


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def test_sse_data_lines_stop_at_done_and_say_whether_it_came() -> None:
    stream = SSEDataLines(_lines(": ping", "data: {}", "", "event: x", "data:[1]", "data: [DONE]", "data: late"))
    assert [data async for data in stream] == ["{}", "[1]"] and stream.is_done
    cut = SSEDataLines(_lines("data: {}", ""))
    assert [data async for data in cut] == ["{}"] and not cut.is_done
