"""A small Anthropic-compatible server on loopback that misbehaves on purpose, chosen by the request's `model`.

    claude-ok        a text answer (streaming: two text deltas)
    claude-tool      a tool_use answer (streaming: input_json_delta fragments)
    claude-429       429 rate_limit_error with retry-after: 7
    claude-400       400 invalid_request_error "prompt is too long"
    claude-500       500 api_error;  claude-529: 529 overloaded_error
    claude-html      200 with an HTML page
    claude-slow      answers after 5 s (for timeouts)
    claude-cut       stream ends cleanly before message_stop
    claude-reset     stream breaks the connection mid-body
    claude-error     stream sends an `error` event (overloaded) after the first delta
    claude-nousage   claude-ok without any `usage` (answer and stream events)

Only the key `upstream-key` is accepted (401 otherwise). Every request is recorded in `FakeAnthropic.requests`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

UPSTREAM_KEY = "upstream-key"


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeAnthropic:
    requests: list[Recorded] = field(default_factory=list)
    # When set, the claude-cut / -reset / -error streams wait for it before they break (at most 5 s): a close that
    # arrives with data the client has not read yet makes aiohttp drop that data, so a test that checks what came
    # before the break sets this once it has read it.
    break_when: asyncio.Event | None = None

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    async def _record(self, request: Request) -> dict[str, Any] | Response:
        body = orjson.loads(await request.body())
        self.requests.append(Recorded(request.url.path, dict(request.headers), body))
        if request.headers.get("x-api-key") != UPSTREAM_KEY:
            return _error(401, "authentication_error", "invalid x-api-key")
        return body  # type: ignore[no-any-return]

    async def count_tokens(self, request: Request) -> Response:
        body = await self._record(request)
        if isinstance(body, Response):
            return body
        return JSONResponse({"input_tokens": len(orjson.dumps(body["messages"])) // 4})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"type": "model", "id": "claude-ok"}], "has_more": False})

    async def messages(self, request: Request) -> Response:
        body = await self._record(request)
        if isinstance(body, Response):
            return body
        model = body["model"]
        if model == "claude-429":
            return _error(429, "rate_limit_error", "slow down", headers={"retry-after": "7"})
        if model == "claude-400":
            return _error(400, "invalid_request_error", "prompt is too long: 300000 tokens > 200000 maximum")
        if model == "claude-500":
            return _error(500, "api_error", "internal")
        if model == "claude-529":
            return _error(529, "overloaded_error", "Overloaded")
        if model == "claude-html":
            return Response("<html><body>login</body></html>", media_type="text/html")
        if model == "claude-slow":
            await asyncio.sleep(5)
        events = _events(model, body)
        if body.get("stream"):
            return StreamingResponse(_sse(model, events, self.break_when), media_type="text/event-stream")
        message = _message(model, is_tool=model == "claude-tool")
        if model == "claude-nousage":
            del message["usage"]
        return JSONResponse(message)


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status, headers=headers
    )


def _message(model: str, *, is_tool: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "Hello from fake"}]
    if is_tool:
        content.append({"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}})
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": "tool_use" if is_tool else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 5},
    }


def _events(model: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    start = {
        **_message(model, is_tool=False),
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 11, "output_tokens": 1},
    }
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " from fake"}},
        {"type": "content_block_stop", "index": 0},
    ]
    stop_reason = "end_turn"
    if model == "claude-tool":
        stop_reason = "tool_use"
        tool = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
        events += [
            {"type": "content_block_start", "index": 1, "content_block": tool},
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"city": '},
            },
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'},
            },
            {"type": "content_block_stop", "index": 1},
        ]
    events += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": 5},
        },
        {"type": "message_stop"},
    ]
    if model == "claude-nousage":
        for event in events:
            event.pop("usage", None)
            if isinstance(event.get("message"), dict):
                event["message"].pop("usage", None)
    return events


async def _sse(model: str, events: list[dict[str, Any]], break_when: asyncio.Event | None) -> AsyncIterator[bytes]:
    for position, event in enumerate(events):
        if model in ("claude-cut", "claude-reset", "claude-error") and position == 4:
            if break_when is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(break_when.wait(), 5.0)
            if model == "claude-reset":
                raise ConnectionResetError("fake upstream dropped the connection")
            if model == "claude-error":
                error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
                yield b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"
            return
        yield b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class LoopbackServer:
    """Runs an ASGI app with uvicorn on a free loopback port inside the test's event loop."""

    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> LoopbackServer:
        self._task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # slow handlers (claude-slow) must not hold up the test
        assert self._task is not None
        await self._task
