"""Serve `/v1/v1/x` and `/x` as `/v1/x` (a client whose base URL has one `/v1` too many or too few) and `/x/` as
`/x`, with no redirect (Starlette's slash redirect would point at whatever Host the client sent), and say so in
`x-unigate-path-normalized: <original> -> <served>` so `unigate doctor` can tell. The header carries both paths
percent-encoded: a decoded path may hold CR/LF or other bytes no header value may.

Paths under `/health`, `/metrics`, `/admin`, `/ui` (and `/docs`, `/favicon.ico`) are never rewritten, a trailing
slash included: no client reaches them through an API base URL, and an operator's script should use the exact
path. With the app's slash redirect off, such a path that names no route is a 404 `not_found` in the envelope."""

from __future__ import annotations

from urllib.parse import quote

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["PathNormalizeMiddleware", "normalize_path"]

# Paths that live outside /v1 and are never rewritten: each root itself and everything below it.
_ROOTS = ("/health", "/metrics", "/admin", "/docs", "/favicon.ico", "/ui")
_UNDER_ROOTS = tuple(root + "/" for root in _ROOTS)


def normalize_path(path: str) -> str:
    if path in _ROOTS or path.startswith(_UNDER_ROOTS):
        return path
    if len(path) > 1 and path.endswith("/"):
        path = path.rstrip("/") or "/"
    while path.startswith("/v1/v1/") or path == "/v1/v1":
        path = path[3:]
    if path.startswith("/v1/") or path in ("/", "/v1"):
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
        note = f"{_header_safe(original)} -> {_header_safe(served)}".encode("ascii")

        async def send_with_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-unigate-path-normalized", note)]
            await send(message)

        await self.app(scope, receive, send_with_note)


def _header_safe(path: str) -> str:
    """`path` percent-encoded down to visible ASCII (RFC 3986 path characters stay as they are)."""
    return quote(path, safe="/:@!$&'()*+,;=-._~%")
