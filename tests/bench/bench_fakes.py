"""A tiny OpenAI-compatible server with injected latencies and failures, on a real loopback socket.

Streams wait `ttft_s` before the first content token and `itl_s` between tokens; a role-only chunk goes out at
once, so a client that takes the first *chunk* for the first token is caught. With `max_concurrent` slots, extra
requests queue for a slot (their TTFT grows), like a saturated engine. Errors use the gateway's envelope codes.

Run standalone (for benchmarks/bench_client_capacity.py): `python tests/bench/bench_fakes.py --port 8123`.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

__all__ = ["FakeConfig", "FakeServer", "build_app"]


@dataclass
class FakeConfig:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    keys: dict[str, str] | None = None  # key -> "ok" | "revoked" | "expired"; None = no auth at all
    allowed_models: dict[str, list[str]] = field(default_factory=dict)  # key -> models it may use
    max_concurrent: int | None = None
    is_usage_honoured: bool = True  # answer stream_options.include_usage
    is_ignore_eos_rejected: bool = False  # like hosted APIs: 400 on unknown fields
    eos_after: int | None = None  # without ignore_eos, stop after this many tokens
    fail_every: int = 0  # every Nth chat request gets a 429 rate_limit_exceeded
    failure: str | None = None  # malformed | non_json | empty_choices | broken_stream | no_done | stream_error |
    # no_choices_stream | rate_limited | not_streaming
    prefix: str = "/v1"
    is_path_normalized: bool = False  # like the gateway: /models and /v1/v1/models work, with a header saying so
    metrics_text: str | None = None  # served at /metrics when set
    received: list[dict[str, Any]] = field(default_factory=list)


def _error(status: int, code: str, message: str, kind: str = "invalid_request_error", **headers: str) -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake-model"}
    payload["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _Fake:
    def __init__(self, config: FakeConfig) -> None:
        self.config = config
        self.num_chat = 0
        self._slots: asyncio.Semaphore | None = None

    def _slot(self) -> asyncio.Semaphore:
        if self._slots is None:  # created lazily: it must belong to the server's event loop
            self._slots = asyncio.Semaphore(self.config.max_concurrent or 1_000_000)
        return self._slots

    def _auth(self, request: Request) -> tuple[Response | None, str | None]:
        keys = self.config.keys
        if keys is None:
            return None, None
        header = request.headers.get("authorization")
        if header is None:
            return _error(401, "missing_api_key", "No API key.", "authentication_error"), None
        if not header.startswith("Bearer ") or " " in header[len("Bearer ") :].strip():
            return _error(
                401, "invalid_auth_header", "Use 'Authorization: Bearer <key>'.", "authentication_error"
            ), None
        key = header[len("Bearer ") :].strip()
        state = keys.get(key)
        if state is None:
            return _error(401, "invalid_api_key", "Invalid API key.", "authentication_error"), None
        if state != "ok":
            return _error(401, f"key_{state}", f"This key is {state}.", "authentication_error"), None
        return None, key

    def _route(self, request: Request) -> tuple[str | None, str | None]:
        """(endpoint, normalisation note) for the request path; endpoint None = unknown route."""
        path = request.url.path.rstrip("/")
        prefix = self.config.prefix
        for endpoint in ("models", "chat/completions"):
            if path == f"{prefix}/{endpoint}":
                return endpoint, None
            if self.config.is_path_normalized and path in (f"/{endpoint}", f"/v1/v1/{endpoint}"):
                return endpoint, f"{path} -> /v1/{endpoint}"
        if path == "/metrics" and self.config.metrics_text is not None:
            return "metrics", None
        return None, None

    async def handle(self, request: Request) -> Response:
        endpoint, note = self._route(request)
        if endpoint is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if endpoint == "metrics":
            return Response(self.config.metrics_text, media_type="text/plain; version=0.0.4")
        denied, key = self._auth(request)
        response = denied or await (self._models() if endpoint == "models" else self._chat(request, key))
        if note is not None:
            response.headers["x-unigate-path-normalized"] = note
        return response

    async def _models(self) -> Response:
        data = [{"id": m, "object": "model", "owned_by": "fake", "dtype": "float16"} for m in self.config.models]
        return JSONResponse({"object": "list", "data": data}, headers={"server": "fake-openai/1.0"})

    async def _chat(self, request: Request, key: str | None) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "invalid_json", "Body is not JSON.")
        self.config.received.append(body)
        self.num_chat += 1
        config = self.config
        if config.is_ignore_eos_rejected and "ignore_eos" in body:
            return JSONResponse(
                {
                    "error": {
                        "message": "Unrecognized request argument supplied: ignore_eos",
                        "type": "invalid_request_error",
                        "param": "ignore_eos",
                        "code": None,
                    }
                },
                status_code=400,
            )
        if body.get("model") not in config.models:
            return _error(404, "model_not_found", f"The model '{body.get('model')}' does not exist.", "not_found_error")
        if key is not None and key in config.allowed_models and body["model"] not in config.allowed_models[key]:
            return _error(403, "model_not_allowed", "Your key may not use this model.", "permission_error")
        if config.failure == "rate_limited" or (config.fail_every and self.num_chat % config.fail_every == 0):
            return _error(429, "rate_limit_exceeded", "Too many requests.", "rate_limit_error", **{"retry-after": "7"})
        num_tokens = int(body.get("max_tokens") or 16)
        if not body.get("ignore_eos") and config.eos_after is not None:
            num_tokens = min(num_tokens, config.eos_after)
        if not body.get("stream") or config.failure == "not_streaming":
            return await self._complete(body, num_tokens)
        is_usage = config.is_usage_honoured and bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._stream(num_tokens, is_usage), media_type="text/event-stream")

    async def _complete(self, body: dict[str, Any], num_tokens: int) -> Response:
        async with self._slot():
            await asyncio.sleep(self.config.ttft_s + self.config.itl_s * max(0, num_tokens - 1))
        failure = self.config.failure
        if failure == "non_json":
            return HTMLResponse("<html><body>Welcome to nginx!</body></html>")
        if failure == "malformed":
            return JSONResponse({"id": "chatcmpl-fake", "object": "chat.completion", "model": body["model"]})
        choices = (
            []
            if failure == "empty_choices"
            else [
                {"index": 0, "message": {"role": "assistant", "content": "OK " * num_tokens}, "finish_reason": "length"}
            ]
        )
        usage = {"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
        return JSONResponse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "model": body["model"],
                "choices": choices,
                "usage": usage,
            }
        )

    async def _stream(self, num_tokens: int, is_usage: bool) -> AsyncIterator[bytes]:
        failure = self.config.failure
        if failure == "no_choices_stream":
            for _ in range(num_tokens):
                yield b'data: {"id": "x", "object": "chat.completion.chunk"}\n\n'
            yield b"data: [DONE]\n\n"
            return
        async with self._slot():
            yield _chunk({"role": "assistant", "content": ""})  # no content: must not count as the first token
            await asyncio.sleep(self.config.ttft_s)
            for i in range(num_tokens):
                if i:
                    await asyncio.sleep(self.config.itl_s)
                if failure == "broken_stream" and i == 2:
                    raise RuntimeError("injected: connection dropped mid-stream")
                if failure == "stream_error" and i == 1:
                    error = {"error": {"message": "Upstream failed.", "type": "api_error", "code": "upstream_error"}}
                    yield b"data: " + orjson.dumps(error) + b"\n\n"
                    return
                yield _chunk({"content": f"t{i} "})
        yield _chunk({}, finish="length")
        if is_usage:
            yield _chunk(
                None, usage={"prompt_tokens": 5, "completion_tokens": num_tokens, "total_tokens": 5 + num_tokens}
            )
        if failure != "no_done":
            yield b"data: [DONE]\n\n"


def build_app(config: FakeConfig) -> ASGIApp:
    from starlette.applications import Starlette

    fake = _Fake(config)
    return Starlette(routes=[Route("/{path:path}", fake.handle, methods=["GET", "POST"])])


class FakeServer:
    """`with FakeServer(FakeConfig(...)) as server:` serves on a free loopback port in a background thread."""

    def __init__(self, config: FakeConfig | None = None, port: int = 0) -> None:
        import socket

        self.config = config or FakeConfig()
        if not port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
        self.port = port
        self._server = uvicorn.Server(
            uvicorn.Config(
                build_app(self.config),
                host="127.0.0.1",
                port=port,
                log_level="critical",
                lifespan="off",
                access_log=False,
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}{self.config.prefix}"

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description="A fake OpenAI-compatible server with injected latencies.")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--itl", type=float, default=0.0, help="seconds between tokens")
    args = parser.parse_args()
    uvicorn.run(
        build_app(FakeConfig(ttft_s=args.ttft, itl_s=args.itl)),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


if __name__ == "__main__":
    main()
