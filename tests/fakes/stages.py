"""The smallest setting for the pipeline's stages on their own (gateway.ledger, gateway.attempt): a scripted backend,
a router over it and a `CallContext` built by hand, with no app and no HTTP request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from auth.base import Principal
from fakes.access import RecordingAccess
from fakes.app import MASTER, make_settings
from gateway.call_context import CallContext
from gateway.metrics import GatewayMetrics
from gateway.router import Router
from gateway.routing_config import parse_routing

__all__ = ["ScriptedBackend", "make_context", "one_model_router"]


@dataclass
class ScriptedBackend:
    """Answers `send` with `answer` (raising it when it is an exception) and `stream` with `chunks`."""

    name: str = "d0"
    answer: Any = field(default_factory=lambda: {"choices": [{"message": {"content": "hi"}}]})
    chunks: list[Any] = field(default_factory=lambda: [{"choices": [{"delta": {"content": "hi"}}]}])
    sent: list[dict[str, Any]] = field(default_factory=list)
    is_stream_closed: bool = False

    def supports(self, endpoint: str) -> bool:
        return endpoint == "chat/completions"

    async def send(
        self,
        endpoint: str,
        body: Any,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Any = None,
    ) -> Any:
        self.sent.append(body)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def stream(
        self,
        endpoint: str,
        body: Any,
        *,
        request_id: str,
        headers: Mapping[str, str] | None = None,
        tenancy: Any = None,
    ) -> AsyncIterator[Any]:
        self.sent.append(body)
        try:
            for chunk in self.chunks:
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
        finally:
            self.is_stream_closed = True

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def one_model_router(backend: ScriptedBackend, **deployment: Any) -> Router:
    """Model `m` served by `backend` alone (no retries: each test sees one attempt)."""
    routing = {
        "models": [{"id": "m", "deployments": [{"type": "openai", "base_url": "http://x/v1", "name": backend.name}]}],
        "router": {"num_retries": 0},
    }
    routing["models"][0]["deployments"][0].update(deployment)  # type: ignore[index]
    return Router(parse_routing(routing, source="t"), {backend.name: backend})  # type: ignore[dict-item]


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def make_context(router: Router, access: RecordingAccess | None = None, **overrides: Any) -> CallContext:
    access = access or RecordingAccess(master_key=MASTER)
    values: dict[str, Any] = {
        "settings": make_settings(),
        "access": access,
        "limiter": access,
        "router": router,
        "metrics": GatewayMetrics(["m"]),
        "credential": MASTER,
        "principal": Principal(key_id=None, name="master", is_master=True),
        "request_id": "req-1",
        "forwarded_headers": None,
        "started_at": 0.0,
        "receive": _never_disconnects,
        "request_state": {},
        **overrides,
    }
    return CallContext(**values)
