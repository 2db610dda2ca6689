"""A local deployment whose engine runs in another process of this host: `EngineClient`.

With `unigate serve --workers N` the engine runs once, in its own process (the engine server of
`gateway.engine_server`, on a Unix socket), and each worker's local deployment is this client of it. It keeps the
local backend's contract (`backends.local.LocalBackend`): the same chunks and responses (the clamp report under
`MAX_TOKENS_CLAMPED_KEY`, `usage` with cached tokens), the same errors (503 `engine_loading` with `Retry-After`
while the model loads, 400s naming the field), `health_state()`, `output_limits()`, `count_prompt_tokens()` and
`stats()`; closing a stream early closes its connection, and the engine server aborts the request, freeing its KV
blocks within a step.

State, stats and the context length are the engine's answers to `GET /engine/state`, asked every
`poll_interval_s` by a background task (the capabilities that report them do no I/O). An engine process that does
not answer (stopped, or being restarted by the parent) makes requests fail at once with 503 `engine_error` (type
`service_unavailable`, never a cooldown) and a `Retry-After`, never hang, and `health_state()` say `down`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from backends.base import Endpoint, HealthState, Json, OutputLimits
from backends.local_mapping import NATIVE_ENDPOINTS
from backends.sse import SSEDecoder
from backends.upstream import encode_body
from gateway.errors import (
    ClientDisconnectedError,
    EngineError,
    EngineLoadingError,
    GatewayError,
    InvalidRequestError,
    LimitError,
    UnavailableError,
)

__all__ = ["EngineClient", "EngineClientConfig", "engine_error_from"]

# Retry-After of a 503 when the engine process does not answer: a restart takes seconds (the model then loads,
# and requests get `engine_loading` from the engine itself).
ENGINE_DOWN_RETRY_AFTER_S = 5
_STATE_TIMEOUT_S = 5.0
_HEALTH_STATES: frozenset[str] = frozenset({"up", "down", "loading", "restarting"})


@dataclass(frozen=True, slots=True)
class EngineClientConfig:
    """One `type: local` deployment served by an engine process. The output-limit fields are the deployment's,
    as the engine process applies them (`backends.local.LocalBackendConfig`)."""

    name: str  # the deployment's stable name (metrics, cooldowns, leases)
    socket_path: str  # the engine server's Unix socket
    clamp_max_tokens: bool = True
    default_max_tokens: int | None = 1024  # None or 0 = none
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # one read from the engine (a long prefill sends nothing meanwhile)
    max_connections: int = 100
    poll_interval_s: float = 1.0


class EngineClient:
    """A local deployment served by the engine process listening on `config.socket_path`."""

    def __init__(self, config: EngineClientConfig) -> None:
        self.name = config.name
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self._state: HealthState = "loading"  # until the engine first answers
        self._engine: Json = {}  # its last answer to GET /engine/state
        self._context_length: int | None = None
        with contextlib.suppress(RuntimeError):  # built outside an event loop: polling starts at first use
            self._start()

    def _start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name=f"unigate-engine-{self.name}")

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the serving event loop (aiohttp binds a session to its loop).
        if self._session is None:
            self._start()
            connector = aiohttp.UnixConnector(
                path=self.config.socket_path, limit=self.config.max_connections, keepalive_timeout=30
            )
            timeout = aiohttp.ClientTimeout(
                total=None, connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
            )
            self._session = aiohttp.ClientSession("http://engine", connector=connector, timeout=timeout)
        return self._session

    # -- Backend protocol ---------------------------------------------------------------------------------------

    def supports(self, endpoint: Endpoint) -> bool:
        return endpoint in NATIVE_ENDPOINTS

    async def send(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> Json:
        return await self._call(f"/engine/send/{endpoint}", body, request_id)

    async def stream(
        self, endpoint: Endpoint, body: Json, *, request_id: str, headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[Json]:
        headers = {"x-request-id": request_id, "content-type": "application/json"}
        try:
            response = await self._client().post(f"/engine/stream/{endpoint}", data=encode_body(body), headers=headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unreachable(exc) from None
        is_done = False
        try:
            if response.status != 200:
                raise engine_error_from(_loads(await response.read()), response.status)
            decoder = SSEDecoder()
            async for raw in response.content.iter_any():
                for _, data in decoder.feed(raw):
                    if is_done:
                        continue
                    if data == b"[DONE]":
                        is_done = True  # read on to the end of the body, so the connection goes back to the pool
                        continue
                    chunk = _loads(data)
                    if "error" in chunk and "choices" not in chunk:
                        raise engine_error_from(chunk, 500)
                    yield chunk
            if not is_done:
                raise self._cut_off()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._cut_off(exc) from None
        finally:
            if is_done:
                response.release()
            else:
                response.close()  # the engine server sees the connection go and aborts the request

    async def count_prompt_tokens(self, body: Json) -> int:
        """The engine's exact count (its tokenizer and chat template), as `LocalBackend.count_prompt_tokens`."""
        data = await self._call("/engine/count_tokens", body, None)
        return int(data["num_tokens"])

    def output_limits(self) -> OutputLimits:
        """The engine's context length (None until it answered with its model loaded), the deployment's clamp and
        default output limit."""
        return OutputLimits(self._context_length, self.config.clamp_max_tokens, self.config.default_max_tokens or None)

    async def check_health(self) -> bool:
        return self.health_state() == "up"

    def health_state(self) -> HealthState:
        """The engine's own state at its last answer (`loading`, `up`, `restarting`, `down`), or `down` when its
        process did not answer."""
        return self._state

    def stats(self) -> dict[str, Any]:
        """The engine's stats at its last answer (at most `poll_interval_s` old), with this deployment's name and
        the engine process's `pid`; `loaded: false` while its model loads or its process does not answer."""
        stats = self._engine.get("stats")
        # `down` with stats: the process answered that its engine is down (e.g. the load failed: `load_failed`,
        # `load_error` come through); `down` with no fresh answer: the process itself did not answer.
        is_answered_down = self._state == "down" and self._engine.get("state") == "down"
        if (self._state == "down" and not is_answered_down) or not isinstance(stats, dict):
            return {"name": self.name, "loaded": False, "load_failed": False, "state": self._state}
        return {"loaded": False, **stats, "name": self.name, "state": self._state, "pid": self._engine.get("pid")}

    async def aclose(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the engine process -------------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask the engine for its state, stats and context length now."""
        try:
            async with asyncio.timeout(_STATE_TIMEOUT_S):
                async with self._client().get("/engine/state") as response:
                    data = _loads(await response.read()) if response.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, GatewayError):
            data = {}
        state = data.get("state")
        if state not in _HEALTH_STATES:
            self._state = "down"
            self._engine = {}  # its last answer is stale: nothing of it is reported
            return
        self._engine = data
        self._state = state
        if isinstance(data.get("context_length"), int):
            self._context_length = data["context_length"]

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.config.poll_interval_s)

    async def _call(self, path: str, body: Json, request_id: str | None) -> Json:
        headers = {"content-type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        try:
            async with self._client().post(path, data=encode_body(body), headers=headers) as response:
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._unreachable(exc) from None
        data = _loads(content)
        if response.status != 200:
            raise engine_error_from(data, response.status)
        return data

    def _unreachable(self, exc: Exception) -> UnavailableError:
        self._state, self._engine = "down", {}
        what = "did not answer in time" if isinstance(exc, TimeoutError) else "is not running"
        return UnavailableError(
            f"The engine process of deployment {self.name!r} {what} (it stopped, or it is being restarted). "
            f"Retry in {ENGINE_DOWN_RETRY_AFTER_S} s.",
            code="engine_error",
            headers={"retry-after": str(ENGINE_DOWN_RETRY_AFTER_S)},
        )

    def _cut_off(self, exc: Exception | None = None) -> UnavailableError:
        if not isinstance(exc, TimeoutError):
            self._state, self._engine = "down", {}
        return UnavailableError(
            f"The engine process of deployment {self.name!r} stopped in the middle of the stream; the output above "
            "is incomplete. Retry the request.",
            code="engine_error",
            headers={"retry-after": str(ENGINE_DOWN_RETRY_AFTER_S)},
        )


def engine_error_from(payload: Json, status: int) -> GatewayError:
    """The gateway error the engine process raised, rebuilt from its payload (`gateway.engine_server.error_payload`;
    a bare OpenAI envelope takes `status`): same class family, status, code, message, param and headers."""
    detail = payload.get("error")
    if not isinstance(detail, dict):
        return EngineError(f"The engine process answered HTTP {status} without an error.", status_code=502)
    if isinstance(payload.get("status"), int):
        status = payload["status"]
    headers = payload.get("headers") if isinstance(payload.get("headers"), dict) else {}
    message, code = str(detail.get("message") or "no detail"), detail.get("code")
    param = detail.get("param") if isinstance(detail.get("param"), str) else None
    kind = {
        "invalid_request_error": InvalidRequestError,
        "rate_limit_error": LimitError,
        "service_unavailable": UnavailableError,
        "client_disconnected": ClientDisconnectedError,
    }.get(str(detail.get("type")), EngineError)
    if code == "engine_loading":
        kind = EngineLoadingError
    if status in (401, 403):  # the engine refused the worker's own credentials: not the caller's to fix
        status = 502
    return kind(message, code=code if isinstance(code, str) else None, param=param, headers=headers, status_code=status)


def _loads(data: bytes) -> Json:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise EngineError("The engine process answered something that is not a JSON object.", status_code=502)
    return value
