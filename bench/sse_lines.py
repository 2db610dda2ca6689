"""The client's view of an OpenAI-style stream (`doctor`): its `data:` payloads, read line by line."""

from __future__ import annotations

from collections.abc import AsyncIterator

__all__ = ["SSEDataLines"]


class SSEDataLines:
    """The payloads of an OpenAI-style stream read line by line: each `data:` line's text, stripped, up to
    `data: [DONE]`, which ends the iteration and sets `is_done`."""

    __slots__ = ("_lines", "is_done")

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self._lines = lines
        self.is_done = False

    async def __aiter__(self) -> AsyncIterator[str]:
        async for line in self._lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                self.is_done = True
                return
            yield data
