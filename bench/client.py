"""The measuring client: one asyncio process, one pooled httpx client, monotonic clocks, streamed chat completions.

Per request: TTFT = first chunk carrying content; ITL = every gap between content chunks; E2E = until `[DONE]`;
output tokens from the final `usage` chunk (`stream_options.include_usage`), else the number of content chunks.
Failures are recorded by the gateway's envelope `code` (or `http_<status>` / a transport name), never raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from bench.workload import BenchRequest
from gateway.sse import SSEDataLines

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
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
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
        started = time.perf_counter()
        result = RequestResult(started_at=started, e2e_s=0.0, num_prompt_tokens=request.num_prompt_tokens)
        try:
            async with self._http.stream(
                "POST",
                f"{self.base_url}/chat/completions",
                content=orjson.dumps(self._body(request)),
                headers={"Content-Type": "application/json"},
            ) as response:
                result.status_code = response.status_code
                if response.status_code != 200:
                    result.error_code = error_code_of(response.status_code, await response.aread())
                else:
                    await self._read_stream(response, result, started)
        except httpx.TimeoutException:
            result.error_code = "timeout"
        except httpx.ConnectError:
            result.error_code = "connection_error"
        except (httpx.RemoteProtocolError, httpx.ReadError):
            result.error_code = "stream_broken"
        except httpx.HTTPError:
            result.error_code = "http_error"
        result.e2e_s = time.perf_counter() - started
        return result

    async def _read_stream(self, response: httpx.Response, result: RequestResult, started: float) -> None:
        last_token_at: float | None = None
        num_chunks = 0
        stream = SSEDataLines(response.aiter_lines())
        async for data in stream:
            now = time.perf_counter()
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                result.error_code = "malformed_chunk"
                return
            if "error" in chunk:
                result.error_code = error_code_of(500, data.encode())
                return
            if _has_content(chunk):
                num_chunks += 1
                if last_token_at is None:
                    result.ttft_s = now - started
                else:
                    result.itl_s.append(now - last_token_at)
                last_token_at = now
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                result.num_output_tokens = usage["completion_tokens"]
                result.is_usage_reported = True
                if isinstance(usage.get("prompt_tokens"), int):
                    result.num_prompt_tokens = usage["prompt_tokens"]
        if not result.is_usage_reported:
            result.num_output_tokens = num_chunks
        if not stream.is_done:
            result.error_code = "stream_incomplete"
        elif result.ttft_s is None:
            result.error_code = "no_content"

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


def _has_content(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list):
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("text"))
