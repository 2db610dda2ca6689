"""Reject bodies over `max_body_bytes` with 413 `body_too_large`, by Content-Length or while reading."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BodyTooLargeError

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.max_body_bytes:
                    raise self._error(int(value))
                break
        num_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise self._error(num_bytes)
            return message

        await self.app(scope, limited_receive, send)

    def _error(self, num_bytes: int) -> BodyTooLargeError:
        return BodyTooLargeError(
            f"The request body is {num_bytes} bytes or more; this gateway accepts at most {self.max_body_bytes} "
            "bytes (UNIGATE_MAX_BODY_BYTES). Send a smaller request (e.g. fewer or smaller images).",
        )
