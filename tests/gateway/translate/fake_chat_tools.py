"""A tiny OpenAI-compatible upstream that calls a tool whenever the request offers tools (streaming and not),
for the tool-call paths the shared fake upstream does not cover. Requests are recorded in `FakeChatTools.bodies`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

ARGUMENT_PIECES = ['{"city"', ': "Par', 'is"}']


@dataclass
class FakeChatTools:
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.bodies.append(body)
        name = body["tools"][0]["function"]["name"] if body.get("tools") else None
        if body.get("stream"):
            return StreamingResponse(_stream(body["model"], name), media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": "Let me check."}
        if name is not None:
            function = {"name": name, "arguments": "".join(ARGUMENT_PIECES)}
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": function}]
        return JSONResponse(
            {
                "id": "chatcmpl-tools",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if name else "stop"}],
                "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
            }
        )


async def _stream(model: str, name: str | None) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        data = {
            "id": "chatcmpl-tools",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [choice],
        }
        return b"data: " + orjson.dumps(data) + b"\n\n"

    yield chunk({"role": "assistant", "content": "Let me "})
    yield chunk({"content": "check."})
    if name is not None:
        first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}
        yield chunk({"tool_calls": [first]})
        for piece in ARGUMENT_PIECES:
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
    yield chunk({}, "tool_calls" if name else "stop")
    usage = {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30}
    data = {
        "id": "chatcmpl-tools",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [],
        "usage": usage,
    }
    yield b"data: " + orjson.dumps(data) + b"\n\n"
    yield b"data: [DONE]\n\n"
