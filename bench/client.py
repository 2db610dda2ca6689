"""The measuring client: one asyncio process, monotonic clocks, streamed chat completions.

Per request: TTFT = first chunk carrying content; ITL = every gap between content chunks; E2E = until `[DONE]`;
output tokens from the final `usage` chunk (`stream_options.include_usage`), else the number of content chunks.
Failures are recorded by the gateway's envelope `code` (or `http_<status>` / a transport name), never raised.

Where the times come from: the streams go over `bench.http_stream`, which takes `time.perf_counter()` first thing
in the event loop's `data_received` callback for every socket read, then strips the HTTP framing and keeps
`(time, body bytes)`. The clock starts just before the request's connection is taken from the pool (its bytes are
encoded before that); a chunk's time is that of the read that completed its SSE event; E2E ends at the read that
carried `[DONE]`. SSE decoding and JSON parsing run later, in the request's own task (woken when the body ends or
every 4 reads), and cannot shift those times. Metadata requests (`/models`, `/version`, `/metrics`) are not timed
and go over an ordinary httpx client (`http`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from backends.sse import SSEDecoder
from bench.http_stream import (
    ConnectError,
    HttpStreamError,
    StreamBrokenError,
    StreamPool,
    StreamResponse,
    StreamTimeoutError,
)
from bench.workload import BenchRequest

__all__ = ["BenchClient", "ProbeResult", "RequestResult", "error_code_of", "server_root"]


@dataclass(slots=True)
class RequestResult:
    started_at: float  # time.perf_counter() when the request was sent
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    error_code: str | None = None
    status_code: int | None = None
    is_usage_reported: bool = False

    @property
    def is_ok(self) -> bool:
        return self.error_code is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class ProbeResult:
    is_ok: bool
    message: str = ""
    is_ignore_eos_sent: bool = True
    is_usage_requested: bool = True


def server_root(base_url: str) -> str:
    """`http://host:8080/v1` -> `http://host:8080`: where /metrics, /health and /version live."""
    parts = urlsplit(base_url.rstrip("/"))
    path = parts.path
    while path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def error_code_of(status_code: int, body: bytes) -> str:
    """The envelope's `code` (OpenAI or Anthropic shape), else its `type`, else `http_<status>`."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"http_{status_code}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        for key in ("code", "type"):
            if isinstance(error.get(key), str) and error[key]:
                return str(error[key])
    return f"http_{status_code}"


class BenchClient:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        model: str,
        *,
        max_connections: int = 64,
        timeout_s: float = 600.0,
        temperature: float | None = 0.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.is_ignore_eos_sent = True
        self.is_usage_requested = True
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._streams = StreamPool(
            self.base_url,
            max_connections=max_connections,
            timeout_s=timeout_s,
            connect_timeout_s=min(timeout_s, 10.0),
            headers=headers,
        )
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._streams.aclose()
        await self._http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """For untimed requests (metadata, /metrics)."""
        return self._http

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "stream": True,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.is_usage_requested:
            body["stream_options"] = {"include_usage": True}
        if self.is_ignore_eos_sent:
            body["ignore_eos"] = True  # so output lengths are what the workload asked for, not what the model chose
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        data = self._streams.encode("POST", "/chat/completions", orjson.dumps(self._body(request)))
        started = time.perf_counter()
        result = RequestResult(started_at=started, e2e_s=0.0, num_prompt_tokens=request.num_prompt_tokens)
        ended_at: float | None = None
        try:
            async with self._streams.request(data) as response:
                result.status_code = response.status_code
                if response.status_code != 200:
                    result.error_code = error_code_of(response.status_code, await response.read())
                else:
                    ended_at = await _read_stream(response, result, started)
        except StreamTimeoutError:
            result.error_code = "timeout"
        except ConnectError:
            result.error_code = "connection_error"
        except StreamBrokenError:
            result.error_code = "stream_broken"
        except HttpStreamError:
            result.error_code = "http_error"
        result.e2e_s = (ended_at if ended_at is not None else time.perf_counter()) - started
        return result

    async def probe(self) -> ProbeResult:
        """One tiny request; drop `ignore_eos` / `stream_options` if the server rejects them (hosted APIs do)."""
        tiny = BenchRequest([{"role": "user", "content": "Say hi."}], max_tokens=4)
        attempts = [(True, True), (False, True), (False, False)]
        message = ""
        for is_ignore_eos_sent, is_usage_requested in attempts:
            self.is_ignore_eos_sent, self.is_usage_requested = is_ignore_eos_sent, is_usage_requested
            result = await self.send(tiny)
            if result.is_ok:
                return ProbeResult(True, "", is_ignore_eos_sent, is_usage_requested)
            message = (
                f"{result.error_code} (HTTP {result.status_code})" if result.status_code else str(result.error_code)
            )
            if result.status_code not in (400, 422):
                break  # only a validation error can be about our optional fields
        self.is_ignore_eos_sent, self.is_usage_requested = True, True
        return ProbeResult(False, message)

    async def server_info(self) -> dict[str, Any]:
        """What the server says about itself: response headers, the model's /models entry, /version if any."""
        info: dict[str, Any] = {}
        try:
            response = await self._http.get(f"{self.base_url}/models")
            for name in ("server", "x-unigate-version", "x-engine-version"):
                if name in response.headers:
                    info[name] = response.headers[name]
            if response.status_code == 200:
                models = response.json().get("data", [])
                entry = next((m for m in models if isinstance(m, dict) and m.get("id") == self.model), None)
                if entry is not None:
                    info["model_entry"] = entry
        except (httpx.HTTPError, ValueError, AttributeError):
            info["models"] = "not available"
        try:
            response = await self._http.get(f"{server_root(self.base_url)}/version")
            if response.status_code == 200 and response.headers.get("content-type", "").startswith("application/json"):
                info["version"] = response.json()
        except (httpx.HTTPError, ValueError):
            pass
        return info


class _DataEvents:
    """The `data` payloads in a stream's body pieces. A piece holding exactly one `data:` line and its blank line
    (the usual case) is cut out directly; anything else goes through the gateway's full SSE decoder."""

    __slots__ = ("_decoder", "_is_clean")

    def __init__(self) -> None:
        self._decoder = SSEDecoder()
        self._is_clean = True  # the decoder holds no partial line or event

    def feed(self, body: bytes) -> list[bytes]:
        if self._is_clean and body.startswith(b"data:") and body.find(b"\n") == len(body) - 2 and body[-1] == 10:
            data = body[5:-2]
            return [data[1:] if data[:1] == b" " else data]
        self._is_clean = body.endswith(b"\n\n")
        return [data for _, data in self._decoder.feed(body)]


async def _read_stream(response: StreamResponse, result: RequestResult, started: float) -> float | None:
    """Fill `result` from the stream; the time `[DONE]` arrived, or None if it never did."""
    events = _DataEvents()
    last_token_at: float | None = None
    num_chunks = 0
    while reads := await response.body_reads():
        for at, body in reads:
            for data in events.feed(body):
                if data.strip() == b"[DONE]":
                    _end_of_stream(result, num_chunks, is_done=True)
                    return at
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    result.error_code = "malformed_chunk"
                    return None
                if not isinstance(chunk, dict):
                    result.error_code = "malformed_chunk"
                    return None
                if "error" in chunk:
                    result.error_code = error_code_of(500, data)
                    return None
                if _has_content(chunk):
                    num_chunks += 1
                    if last_token_at is None:
                        result.ttft_s = at - started
                    else:
                        result.itl_s.append(at - last_token_at)
                    last_token_at = at
                _read_usage(chunk, result)
    _end_of_stream(result, num_chunks, is_done=False)
    return None


def _read_usage(chunk: dict[str, Any], result: RequestResult) -> None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.num_output_tokens = usage["completion_tokens"]
        result.is_usage_reported = True
        if isinstance(usage.get("prompt_tokens"), int):
            result.num_prompt_tokens = usage["prompt_tokens"]


def _end_of_stream(result: RequestResult, num_chunks: int, *, is_done: bool) -> None:
    if not result.is_usage_reported:
        result.num_output_tokens = num_chunks
    if not is_done:
        result.error_code = "stream_incomplete"
    elif result.ttft_s is None:
        result.error_code = "no_content"


def _has_content(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list):
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("text"))
