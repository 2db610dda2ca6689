"""Serve `/v1/v1/x` and `/x` as `/v1/x` (a client whose base URL has one `/v1` too many or too few), with no
redirect, and say so in `x-unigate-path-normalized: <original> -> <served>` so `unigate doctor` can tell."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PathNormalizeMiddleware", "normalize_path"]

# Paths that live outside /v1 and are never rewritten.
_ROOTS = ("/health", "/metrics", "/admin", "/docs", "/favicon.ico")


def normalize_path(path: str) -> str:
    while path.startswith("/v1/v1/") or path == "/v1/v1":
        path = path[3:]
    if path.startswith("/v1/") or path in ("/", "/v1") or path.startswith(_ROOTS):
        return path
    return "/v1" + path


class PathNormalizeMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        original = scope["path"]
        served = normalize_path(original)
        if served == original:
            await self.app(scope, receive, send)
            return
        scope["path"] = served
        scope["raw_path"] = served.encode()
        note = f"{original} -> {served}".encode("latin-1", "replace")

        async def send_with_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-unigate-path-normalized", note)]
            await send(message)

        await self.app(scope, receive, send_with_note)
