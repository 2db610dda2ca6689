"""`unigate doctor`: check the three things every client config needs (base URL, key, model ID) against any
OpenAI-compatible server, with the smallest requests, and explain each failure in plain words with its fix.

Steps, each stopping the run when nothing after it could succeed:
    1. the inputs themselves (scheme, a key pasted with `Bearer `, an endpoint pasted as the base URL)
    2. GET {base}/models: reachability (refused, DNS, TLS, timeout), the `/v1` form of the base URL, the key
    3. POST {base}/chat/completions, max_tokens=1: model found and allowed, limits, the shape of `choices`
    4. the same with stream=true: SSE framing, chunks, the closing `data: [DONE]`
    5. the Anthropic Messages and Responses surfaces (Claude Code, Codex): reported, never fatal
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from bench.doctor_explain import error_envelope, explain_error, transport_failure
from bench.sse_lines import SSEDataLines

__all__ = ["Check", "CheckStatus", "Diagnosis", "client_config", "diagnose", "explain_error", "server_root"]

PATH_NORMALIZED_HEADER = "x-unigate-path-normalized"


class CheckStatus(Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(slots=True)
class Check:
    name: str
    status: CheckStatus
    detail: str
    fix: str | None = None


@dataclass(slots=True)
class Diagnosis:
    base_url: str  # as given
    model: str
    verified_base_url: str | None = None  # the working base URL (with /v1), once a chat completion succeeded
    checks: list[Check] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the listed model id it names

    @property
    def is_ok(self) -> bool:
        return all(check.status is not CheckStatus.FAIL for check in self.checks)

    def add(self, name: str, status: CheckStatus, detail: str, fix: str | None = None) -> Check:
        check = Check(name, status, detail, fix)
        self.checks.append(check)
        return check


def server_root(base_url: str) -> str:
    """`http://host:8080/v1/v1` -> `http://host:8080`."""
    parts = urlsplit(base_url.rstrip("/"))
    path = parts.path.rstrip("/")
    while path.endswith("/v1"):
        path = path[: -len("/v1")].rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _is_api_answer(response: httpx.Response) -> bool:
    """A response that came from an OpenAI-style API rather than a missing route or a web page."""
    if response.status_code == 404:
        return False
    return "json" in response.headers.get("content-type", "")


def _validate_inputs(diagnosis: Diagnosis, base_url: str, api_key: str) -> tuple[str, str] | None:
    """The given (base URL, key) cleaned up, with a FAIL for each mistake; None when nothing can be tried."""
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        diagnosis.add(
            "base URL",
            CheckStatus.FAIL,
            f"`{base_url}` is not an http(s) URL",
            "use the form http://HOST:PORT/v1 (or https://…)",
        )
        return None
    cleaned = base_url.strip().rstrip("/")
    for endpoint in ("/chat/completions", "/completions", "/models", "/messages", "/responses"):
        if cleaned.endswith(endpoint):
            cleaned = cleaned[: -len(endpoint)]
            diagnosis.add(
                "base URL",
                CheckStatus.FAIL,
                f"the base URL ends with the endpoint `{endpoint}`",
                f"use {cleaned} as the base URL: clients append `{endpoint}` themselves",
            )
            break
    key = api_key.strip()
    if key.lower().startswith("bearer "):
        key = key[len("bearer ") :].strip()
        diagnosis.add(
            "API key",
            CheckStatus.FAIL,
            "the key was given with a `Bearer ` prefix: clients add it "
            "themselves, so the server would receive `Bearer Bearer …`",
            "pass the key alone",
        )
    return cleaned, key


async def _check_models(
    http: httpx.AsyncClient, diagnosis: Diagnosis, base: str, key: str, timeout_s: float
) -> str | None:
    """Reach GET /models, settle the base URL form and the key; returns the working base URL or None to stop."""
    root = server_root(base)
    canonical = f"{root}/v1"
    try:
        response = await http.get(f"{base}/models")
    except httpx.HTTPError as exc:
        what, fix = transport_failure(exc, base, timeout_s)
        diagnosis.add("connect", CheckStatus.FAIL, what, fix)
        return None
    diagnosis.add("connect", CheckStatus.OK, f"{urlsplit(base).netloc} answered HTTP {response.status_code}")
    working = base
    if PATH_NORMALIZED_HEADER in response.headers:
        diagnosis.add(
            "base URL",
            CheckStatus.WARN,
            f"`{base}` only works because unigate repairs the path ({response.headers[PATH_NORMALIZED_HEADER]})",
            f"set the base URL to {canonical} so other servers and tools work too",
        )
        working = canonical  # the form every client accepts; the rest of the checks use it
    elif not _is_api_answer(response) and base != canonical:
        try:
            retry = await http.get(f"{canonical}/models")
        except httpx.HTTPError:
            retry = None
        if retry is not None and _is_api_answer(retry):
            doubled = urlsplit(base).path.rstrip("/").endswith("/v1/v1")
            what = "`/v1` appears twice in the base URL" if doubled else "the base URL lacks `/v1`"
            diagnosis.add(
                "base URL",
                CheckStatus.FAIL,
                f"{what}: GET {base}/models answered HTTP {response.status_code}, GET {canonical}/models works",
                f"use {canonical} as the base URL",
            )
            working, response = canonical, retry
    if not _is_api_answer(response):
        diagnosis.add(
            "API",
            CheckStatus.FAIL,
            f"no OpenAI-compatible API at {working}: GET /models answered HTTP {response.status_code} "
            f"({response.headers.get('content-type', 'no content type')})",
            "check the base URL: it is the part before /chat/completions, usually ending in /v1",
        )
        return None
    if response.status_code in (401, 403) and error_envelope(response.content)[0] != "admin_only":
        what, fix = _explain(response, key, diagnosis)
        diagnosis.add("API key", CheckStatus.FAIL, what, fix)
        return None
    if response.status_code == 200:
        _check_model_listed(diagnosis, response)
    else:
        what, _ = _explain(response, key, diagnosis)
        diagnosis.add("models", CheckStatus.WARN, f"GET /models failed: {what}")
    return working


def _explain(response: httpx.Response, key: str, diagnosis: Diagnosis) -> tuple[str, str]:
    """`explain_error` for a read error response, with this run's key, model and the models listed so far."""
    return explain_error(
        response.status_code,
        response.content,
        response.headers,
        api_key=key,
        model=diagnosis.model,
        models=diagnosis.models,
    )


def _check_model_listed(diagnosis: Diagnosis, response: httpx.Response) -> None:
    try:
        data = response.json().get("data", [])
        listed = [m for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError, TypeError):
        diagnosis.add("models", CheckStatus.WARN, 'GET /models did not return the usual {"data": [...]} list')
        return
    diagnosis.models = [str(m["id"]) for m in listed]
    diagnosis.aliases = _aliases(listed)
    diagnosis.add("API key", CheckStatus.OK, "accepted")
    if diagnosis.model in diagnosis.models:
        diagnosis.add("model", CheckStatus.OK, f"`{diagnosis.model}` is listed ({len(diagnosis.models)} models)")
        return
    if diagnosis.model in diagnosis.aliases:
        diagnosis.add(
            "model", CheckStatus.OK, f"`{diagnosis.model}` is an alias of `{diagnosis.aliases[diagnosis.model]}`"
        )
        return
    close = difflib.get_close_matches(diagnosis.model, [*diagnosis.models, *diagnosis.aliases], n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    diagnosis.add(
        "model",
        CheckStatus.WARN,
        f"`{diagnosis.model}` is not in the model list ({', '.join(diagnosis.models[:20]) or 'empty'}).{hint}"
        " The chat request below decides whether it is served.",
    )


def _aliases(listed: list[dict[str, Any]]) -> dict[str, str]:
    """alias -> model id, from the `aliases` lists unigate adds to its model objects (other servers have none)."""
    aliases: dict[str, str] = {}
    for model in listed:
        names = model.get("aliases")
        if isinstance(names, list):
            aliases.update((str(name), str(model["id"])) for name in names)
    return aliases


def _chat_body(model: str, *, stream: bool) -> bytes:
    # One token answers "does it work"; a stream needs a few chunks to show whether its framing holds.
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 5 if stream else 1,
        "stream": stream,
    }
    return orjson.dumps(body)


_CHOICES_FIX = (
    'clients that read `choices[0]` fail on this ("Cannot read properties of undefined (reading '
    "'choices')\"); the server or a proxy in front of it returns a non-standard body: report it to its "
    "admin, or route the model through unigate, which repairs such answers"
)


def _check_completion_body(diagnosis: Diagnosis, response: httpx.Response, elapsed_ms: float) -> bool:
    try:
        payload = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        diagnosis.add(
            "chat completion",
            CheckStatus.FAIL,
            f"HTTP 200 but the body is not JSON: {response.content[:120]!r}",
            _CHOICES_FIX,
        )
        return False
    if isinstance(payload, dict) and "error" in payload and "choices" not in payload:
        _, message = error_envelope(response.content)
        diagnosis.add("chat completion", CheckStatus.FAIL, f"HTTP 200 carrying an error: {message}", _CHOICES_FIX)
        return False
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices:
        shown = "missing" if choices is None else f"{choices!r}"
        diagnosis.add(
            "chat completion",
            CheckStatus.FAIL,
            f"the answer has no usable `choices` ({shown}): {response.content[:160]!r}",
            _CHOICES_FIX,
        )
        return False
    first = choices[0]
    if not isinstance(first, dict) or not isinstance(first.get("message"), dict):
        diagnosis.add("chat completion", CheckStatus.FAIL, f"`choices[0].message` is missing: {first!r}", _CHOICES_FIX)
        return False
    text = first["message"].get("content")
    diagnosis.add("chat completion", CheckStatus.OK, f"answered in {elapsed_ms:.0f} ms: {str(text)[:40]!r}")
    if not isinstance(payload.get("usage"), dict):
        diagnosis.add("usage", CheckStatus.WARN, "the answer carries no `usage`: token accounting will be missing")
    return True


async def _check_chat(http: httpx.AsyncClient, diagnosis: Diagnosis, base: str, key: str, timeout_s: float) -> bool:
    started = time.perf_counter()
    try:
        response = await http.post(f"{base}/chat/completions", content=_chat_body(diagnosis.model, stream=False))
    except httpx.HTTPError as exc:
        what, fix = transport_failure(exc, base, timeout_s)
        diagnosis.add("chat completion", CheckStatus.FAIL, what, fix)
        return False
    elapsed_ms = (time.perf_counter() - started) * 1000
    if response.status_code != 200:
        what, fix = _explain(response, key, diagnosis)
        diagnosis.add("chat completion", CheckStatus.FAIL, what, fix)
        return False
    return _check_completion_body(diagnosis, response, elapsed_ms)


_STREAM_FIX = (
    "a proxy or load balancer between you and the server may buffer or cut streams (disable response "
    "buffering, raise idle timeouts), or the upstream broke mid-answer: retry and check server logs"
)


async def _check_stream(http: httpx.AsyncClient, diagnosis: Diagnosis, base: str, key: str, timeout_s: float) -> None:
    num_chunks = num_with_choices = 0
    is_done = False
    try:
        async with http.stream(
            "POST", f"{base}/chat/completions", content=_chat_body(diagnosis.model, stream=True)
        ) as response:
            if response.status_code != 200:
                await response.aread()
                what, fix = _explain(response, key, diagnosis)
                diagnosis.add("streaming", CheckStatus.FAIL, what, fix)
                return
            content_type = response.headers.get("content-type", "")
            if "text/event-stream" not in content_type:
                diagnosis.add(
                    "streaming",
                    CheckStatus.FAIL,
                    f"stream=true was answered with `{content_type or 'no content type'}`, not "
                    "text/event-stream: streaming clients will fail",
                    _STREAM_FIX,
                )
                return
            stream = SSEDataLines(response.aiter_lines())
            async for data in stream:
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    diagnosis.add("streaming", CheckStatus.FAIL, f"a chunk is not JSON: {data[:120]!r}", _STREAM_FIX)
                    return
                num_chunks += 1
                if isinstance(chunk, dict) and "error" in chunk:
                    code, message = error_envelope(data.encode())
                    diagnosis.add(
                        "streaming", CheckStatus.FAIL, f"the stream carried an error ({code}): {message}", _STREAM_FIX
                    )
                    return
                if isinstance(chunk, dict) and isinstance(chunk.get("choices"), list) and chunk["choices"]:
                    num_with_choices += 1
            is_done = stream.is_done
    except httpx.HTTPError as exc:
        diagnosis.add(
            "streaming",
            CheckStatus.FAIL,
            f"the connection broke mid-stream after {num_chunks} chunks ({type(exc).__name__})",
            _STREAM_FIX,
        )
        return
    if num_chunks and not num_with_choices:
        diagnosis.add("streaming", CheckStatus.FAIL, f"none of the {num_chunks} chunks has `choices`", _CHOICES_FIX)
    elif not is_done:
        diagnosis.add(
            "streaming",
            CheckStatus.FAIL,
            f"the stream ended after {num_chunks} chunks without `data: [DONE]`: clients wait or report "
            "an incomplete answer",
            _STREAM_FIX,
        )
    else:
        diagnosis.add("streaming", CheckStatus.OK, f"{num_chunks} chunks, closed with [DONE]")


async def _check_other_surfaces(http: httpx.AsyncClient, diagnosis: Diagnosis, base: str, key: str) -> None:
    """Claude Code needs /v1/messages and Codex /v1/responses; a missing one is worth knowing, never fatal."""
    root = server_root(base)
    probes: tuple[tuple[str, str, dict[str, Any], dict[str, str]], ...] = (
        (
            "Anthropic Messages (Claude Code)",
            f"{root}/v1/messages",
            {"model": diagnosis.model, "max_tokens": 1, "messages": [{"role": "user", "content": "Say OK."}]},
            {"x-api-key": key, "anthropic-version": "2023-06-01"},
        ),
        (
            "OpenAI Responses (Codex)",
            f"{base}/responses",
            {"model": diagnosis.model, "input": "Say OK.", "max_output_tokens": 16},
            {},
        ),
    )
    for name, url, body, headers in probes:
        try:
            response = await http.post(url, content=orjson.dumps(body), headers=headers)
        except httpx.HTTPError as exc:
            diagnosis.add(name, CheckStatus.WARN, f"request failed ({type(exc).__name__})")
            continue
        if response.status_code == 200:
            diagnosis.add(name, CheckStatus.OK, "answered")
        elif response.status_code in (404, 405):
            diagnosis.add(
                name,
                CheckStatus.WARN,
                f"not served here (HTTP {response.status_code})",
                "tools that need it will not work against this base URL",
            )
        else:
            what, _ = _explain(response, key, diagnosis)
            diagnosis.add(name, CheckStatus.WARN, what)


async def diagnose(
    base_url: str,
    api_key: str,
    model: str,
    *,
    timeout_s: float = 20.0,
    is_surfaces_checked: bool = True,
) -> Diagnosis:
    """Run the checks in order; never raises for anything the server or network does."""
    diagnosis = Diagnosis(base_url=base_url, model=model)
    cleaned = _validate_inputs(diagnosis, base_url, api_key)
    if cleaned is None:
        return diagnosis
    base, key = cleaned
    if not key:
        diagnosis.add("API key", CheckStatus.WARN, "no key given: trying without one (local servers may not need it)")
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
    async with httpx.AsyncClient(headers=headers, timeout=timeout, follow_redirects=False) as http:
        working = await _check_models(http, diagnosis, base, key, timeout_s)
        if working is None:
            return diagnosis
        if not await _check_chat(http, diagnosis, working, key, timeout_s):
            return diagnosis
        diagnosis.verified_base_url = working
        await _check_stream(http, diagnosis, working, key, timeout_s)
        if is_surfaces_checked:
            await _check_other_surfaces(http, diagnosis, working, key)
    return diagnosis


def client_config(base_url: str, model: str, api_key: str | None = None) -> str:
    """Ready-to-paste settings for every client we support; the key only appears if given."""
    v1 = f"{server_root(base_url)}/v1"
    root = server_root(base_url)
    key = api_key or "<your-unigate-key>"
    return f"""\
# Environment (read by the OpenAI SDKs and many OpenAI-compatible tools)
export UNIGATE_API_KEY={key}
export OPENAI_BASE_URL={v1}
export OPENAI_API_KEY="$UNIGATE_API_KEY"

# curl
curl {v1}/chat/completions \\
  -H "Authorization: Bearer $UNIGATE_API_KEY" \\
  -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}]}}'

# OpenAI Python SDK
import os
from openai import OpenAI
client = OpenAI(base_url="{v1}", api_key=os.environ["UNIGATE_API_KEY"])
reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello"}}])
print(reply.choices[0].message.content)

# Anthropic Python SDK (base URL without /v1: the SDK adds it)
import os
from anthropic import Anthropic
client = Anthropic(base_url="{root}", api_key=os.environ["UNIGATE_API_KEY"])
message = client.messages.create(model="{model}", max_tokens=256, messages=[{{"role": "user", "content": "Hello"}}])
print(message.content[0].text)

# Cline: Settings → API Provider "OpenAI Compatible"
#   Base URL: {v1}
#   API Key:  {key}
#   Model ID: {model}

# Claude Code (speaks the Anthropic Messages API; base URL without /v1)
export ANTHROPIC_BASE_URL={root}
export ANTHROPIC_AUTH_TOKEN="$UNIGATE_API_KEY"   # sent as Authorization: Bearer; or set ANTHROPIC_API_KEY instead
export ANTHROPIC_MODEL={model}
export ANTHROPIC_DEFAULT_HAIKU_MODEL={model}   # background tasks (older versions: ANTHROPIC_SMALL_FAST_MODEL)
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1

# Codex CLI: ~/.codex/config.toml (speaks the OpenAI Responses API; reads the key from UNIGATE_API_KEY)
model_provider = "unigate"
model = "{model}"

[model_providers.unigate]
name = "unigate"
base_url = "{v1}"
env_key = "UNIGATE_API_KEY"
wire_api = "responses"
"""
