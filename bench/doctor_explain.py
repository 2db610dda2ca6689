"""Plain-words explanations for `unigate doctor`: what an error response or a failed connection means for the
client, and how to fix it. Pure functions over status codes, error envelopes, headers and exception chains."""

from __future__ import annotations

import difflib
from urllib.parse import urlsplit

import httpx
import orjson

__all__ = ["KEY_PREFIX", "error_envelope", "explain_error", "transport_failure"]

KEY_PREFIX = "sk-ug-"


def error_envelope(body: bytes) -> tuple[str | None, str]:
    """(code, message) from an OpenAI or Anthropic error envelope, or (None, the first bytes of the body)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, body[:200].decode("utf-8", "replace").strip()
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return (str(code) if code else None), str(error.get("message", ""))
    if isinstance(error, str):
        return None, error
    return None, body[:200].decode("utf-8", "replace").strip()


_AUTH_EXPLANATIONS = {
    "missing_api_key": ("no API key reached the server", "set the key in your client (here: --api-key)"),
    "invalid_auth_header": (
        "the Authorization header is malformed: it must be exactly `Authorization: Bearer <key>`",
        "send the key with the `Bearer ` prefix (once, followed by one space), or as `x-api-key: <key>`",
    ),
    "key_revoked": ("this key was revoked", "ask your gateway admin for a new key (`unigate keys create`)"),
    "key_expired": ("this key has expired", "ask your gateway admin for a new key or a later expiry"),
}

_LIMIT_EXPLANATIONS = {
    "rate_limit_exceeded": "your key sent more requests per minute than its limit allows",
    "tokens_limit_exceeded": "your key used more tokens per minute than its limit allows",
    "concurrency_limit_exceeded": "your key has as many requests in flight as its limit allows",
    "budget_exceeded": "your key has spent its budget; waiting will not help: ask the admin to raise it",
    "upstream_rate_limited": "the upstream provider rate limited the gateway (not your key)",
}

_UPSTREAM_EXPLANATIONS = {
    "upstream_auth_failed": "the gateway's own key for the upstream provider was rejected: the gateway admin must "
    "fix the upstream key in the routing file",
    "upstream_unreachable": "the gateway cannot reach the upstream server: it is down or its address is wrong in "
    "the routing file",
    "upstream_timeout": "the upstream took too long to answer: it may be overloaded; retry, or ask the admin about "
    "timeouts",
    "upstream_malformed_response": "the upstream answered something that is not a valid chat completion",
    "upstream_at_capacity": "every upstream slot for this model is busy: retry shortly, or ask the admin to raise "
    "max_in_flight",
    "limits_unavailable": "the gateway cannot reach its Redis, so it refuses requests rather than run without limits",
    "upstream_error": "the upstream returned an error",
}


def _auth_explanation(code: str | None, message: str, api_key: str) -> tuple[str, str]:
    if code in _AUTH_EXPLANATIONS:
        return _AUTH_EXPLANATIONS[code]
    if not api_key:
        return _AUTH_EXPLANATIONS["missing_api_key"]
    if code == "invalid_api_key" and not api_key.startswith(KEY_PREFIX):
        provider = " (it looks like an Anthropic key)" if api_key.startswith("sk-ant-") else ""
        return (
            f"the server does not know this key{provider}; unigate keys start with `{KEY_PREFIX}`",
            "use the key your gateway admin gave you (`unigate keys create`), not an upstream provider's key",
        )
    shown = f"{api_key[:6]}…{api_key[-4:]}" if len(api_key) > 12 else "…"
    return (
        f"the server rejected the key {shown} ({len(api_key)} characters): {message or 'no reason given'}",
        "check the key for a copy-paste error (missing characters, quotes, spaces) or ask for a new one",
    )


def explain_error(
    status_code: int, body: bytes, headers: httpx.Headers, *, api_key: str, model: str, models: list[str]
) -> tuple[str, str]:
    """(what happened, how to fix it) for an error response, in plain words."""
    code, message = error_envelope(body)
    said = f" (server said: {message})" if message else ""
    if status_code == 401 or code in _AUTH_EXPLANATIONS:
        return _auth_explanation(code, message, api_key)
    if status_code == 403:
        if code == "model_not_allowed" or "model" in message.lower():
            return (
                f"your key may not use the model `{model}`{said}",
                "use a model your key allows, or ask the admin to add it to the key's model list",
            )
        return f"permission denied{said}", "ask the gateway admin for a key with the needed permissions"
    if status_code == 404:
        available = ", ".join(models[:20]) + (" …" if len(models) > 20 else "") if models else "none listed"
        close = difflib.get_close_matches(model, models, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        return (
            f"the model `{model}` was not found{said}. Available models: {available}{hint}",
            "use one of the model IDs above, exactly as written (they are case-sensitive)",
        )
    if status_code == 429 or code in _LIMIT_EXPLANATIONS:
        retry = headers.get("retry-after")
        what = _LIMIT_EXPLANATIONS.get(code or "", f"rate limited{said}")
        return (
            f"{what}" + (f"; retry after {retry} s" if retry else ""),
            "wait and retry with backoff, or ask the admin for a higher limit",
        )
    if code in _UPSTREAM_EXPLANATIONS:
        return f"{_UPSTREAM_EXPLANATIONS[code]}{said}", "this is server-side: report it to the gateway admin"
    if status_code == 400:
        return f"the server refused the request as invalid{said}", "check the model ID and the request parameters"
    return f"HTTP {status_code}{said}", "retry; if it persists, report it to the server's admin"


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and every cause under it (httpx -> httpcore -> anyio -> the OS error that says why)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def transport_failure(exc: httpx.HTTPError, url: str, timeout_s: float) -> tuple[str, str]:
    chain = _exception_chain(exc)
    text = " ".join(repr(e) for e in chain).lower()
    host = urlsplit(url).netloc
    if isinstance(exc, httpx.ConnectTimeout):
        return (
            f"no answer from {host} within {timeout_s:g} s: the host is unreachable or a firewall drops traffic",
            "check the host and port, VPN and firewall rules",
        )
    if isinstance(exc, httpx.TimeoutException):
        return (
            f"{host} accepted the connection but did not answer within {timeout_s:g} s",
            "the server may be overloaded or stuck; retry, or check its logs",
        )
    if "ssl" in text or "certificate" in text or "tls" in text:
        if "wrong version number" in text or "record layer" in text or "http_request" in text:
            return (
                f"TLS handshake failed: {host} speaks plain HTTP, not HTTPS",
                f"use http:// instead of https:// ({url.replace('https://', 'http://', 1)})",
            )
        return (
            f"TLS failed when connecting to {host}: {exc}",
            "check the certificate (a self-signed one needs your CA bundle) or the https:// in the base URL",
        )
    if (
        "name or service not known" in text
        or "nodename nor servname" in text
        or "name resolution" in text
        or ("getaddrinfo" in text)
    ):
        return (f"the host name in {url} does not resolve (DNS)", "check the spelling of the host in the base URL")
    if "refused" in text or any(isinstance(e, ConnectionRefusedError) for e in chain):
        return (
            f"connection refused by {host}: nothing listens on that port",
            "check the port in the base URL and that the server is running (`unigate serve`)",
        )
    if isinstance(exc, httpx.RemoteProtocolError):
        return (
            f"{host} did not answer with valid HTTP: {exc}",
            "if the server uses TLS, use https:// in the base URL; otherwise check the port",
        )
    return f"cannot connect to {host}: {exc}", "check the base URL, host and port"
