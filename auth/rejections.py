"""What a refused key or request is told: the errors of an admission the `admit_request` script refused (the key's
own, or its team's: then the message names the team), of a key whose cached record says no, and OpenAI's
`x-ratelimit-*` headers. Pure functions of the script's reply."""

from __future__ import annotations

import math

from auth.base import Principal
from auth.scripts import AdmitReply
from gateway.errors import AuthError, BudgetExceededError, GatewayError, LimitError, PermissionDeniedError

__all__ = ["expired_error", "format_reset", "rate_limit_headers", "rejection", "revoked_error", "unknown_key_error"]


def format_reset(ms: int) -> str:
    """OpenAI's duration style for x-ratelimit-reset-*: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, rest_ms = divmod(ms, 60_000)
    seconds = f"{rest_ms / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def _retry_after(ms: int) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(ms / 1000)))}


def revoked_error() -> AuthError:
    return AuthError("This API key has been revoked. Ask the gateway admin for a new key.", code="key_revoked")


def expired_error() -> AuthError:
    return AuthError(
        "This API key has expired. Ask the gateway admin to extend it (PATCH expires_at) or for a new key.",
        code="key_expired",
    )


def unknown_key_error() -> AuthError:
    return AuthError(
        "Invalid API key: no such key (or it was rotated). Check for typos or create one with `unigate keys create`."
    )


def rate_limit_headers(reply: AdmitReply) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers. A remaining count the script did not get to (-1 on a rejection by an
    earlier check) is left out with its reset rather than reported as 0."""
    headers: dict[str, str] = {}
    if reply.rpm_limit >= 0:
        headers["x-ratelimit-limit-requests"] = str(reply.rpm_limit)
        if reply.rpm_remaining >= 0:
            headers["x-ratelimit-remaining-requests"] = str(reply.rpm_remaining)
            headers["x-ratelimit-reset-requests"] = format_reset(reply.rpm_reset_ms)
    if reply.tpm_limit >= 0:
        headers["x-ratelimit-limit-tokens"] = str(reply.tpm_limit)
        if reply.tpm_remaining >= 0:
            headers["x-ratelimit-remaining-tokens"] = str(reply.tpm_remaining)
            headers["x-ratelimit-reset-tokens"] = format_reset(reply.tpm_reset_ms)
    return headers


def rejection(
    reply: AdmitReply,
    principal: Principal | None,
    model: str,
    estimated_tokens: int,
    *,
    team_name: str | None = None,
) -> GatewayError:
    """The error for a reply whose status is not `ok` (`principal`: the key's, when known, for its allowlist).
    `team_name` given: the reply is the key's team's, and the message says it was the team's limit."""
    status, retry_ms = reply.status, reply.retry_after_ms
    if status == "key_revoked":
        return revoked_error()
    if status == "key_expired":
        return expired_error()
    scope = "this API key" if team_name is None else f"team '{team_name}'"
    if status == "model_not_allowed":
        if team_name is not None:
            allowed = ", ".join(principal.team_models) if principal is not None else "(see the team's settings)"
            return PermissionDeniedError(
                f"This API key's team '{team_name}' may not use model '{model}'. The team's allowed models: "
                f"{allowed}. Ask the gateway admin to add it to the team.",
                code="model_not_allowed",
                param="model",
            )
        allowed = ", ".join(principal.models) if principal is not None else "(see the key's settings)"
        return PermissionDeniedError(
            f"This API key may not use model '{model}'. Allowed models: {allowed}. Ask the gateway admin to add it.",
            code="model_not_allowed",
            param="model",
        )
    if status == "budget_exceeded":
        return _budget_error(reply, team_name)
    if status == "concurrency_limit_exceeded":
        shared = "" if team_name is None else ", shared by the team's keys"
        return LimitError(
            f"Too many concurrent requests for {scope} (max_concurrent{shared}). Wait for one to finish and retry.",
            code="concurrency_limit_exceeded",
            headers=_retry_after(retry_ms),
        )
    headers = {**_retry_after(retry_ms), **rate_limit_headers(reply)}
    if status == "rate_limit_exceeded":
        what = (
            f"{reply.rpm_limit} requests per minute for this API key"
            if team_name is None
            else f"team '{team_name}' rpm limit of {reply.rpm_limit} requests per minute, shared by the team's keys"
        )
        return LimitError(
            f"Rate limit reached: {what}. Retry after {headers['retry-after']} s.",
            code="rate_limit_exceeded",
            headers=headers,
        )
    if status == "tokens_limit_exceeded":
        limit = (
            f"this key's whole limit of {reply.tpm_limit} tokens per minute"
            if team_name is None
            else f"team '{team_name}' whole tpm limit of {reply.tpm_limit} tokens per minute"
        )
        if estimated_tokens > reply.tpm_limit:
            # Waiting never helps: no retry hint (the headers still say what is left in the window).
            return LimitError(
                f"This request may use up to {estimated_tokens} tokens, more than {limit}, so it can never fit. "
                "Lower max_tokens or shorten the prompt.",
                code="tokens_limit_exceeded",
                headers=rate_limit_headers(reply),
            )
        what = (
            f"{reply.tpm_limit} tokens per minute for this API key"
            if team_name is None
            else f"team '{team_name}' tpm limit of {reply.tpm_limit} tokens per minute, shared by the team's keys"
        )
        message = f"Token rate limit reached: {what}. Retry after {headers['retry-after']} s, or lower max_tokens."
        return LimitError(message, code="tokens_limit_exceeded", headers=headers)
    return unknown_key_error()


def _usd(micros: int) -> str:
    return f"${micros / 1e6:,.6f}".rstrip("0").rstrip(".")


def _budget_error(reply: AdmitReply, team_name: str | None) -> BudgetExceededError:
    retry_ms = reply.retry_after_ms
    left = max(reply.budget_limit - reply.budget_spent - reply.budget_held, 0)
    if reply.budget_unit == "micros":
        figures = (_usd(left), _usd(reply.budget_spent), _usd(reply.budget_limit), _usd(reply.budget_held))
        need, field_name = _usd(reply.budget_needed), "budget_usd"
    else:
        figures = (f"{left} tokens", str(reply.budget_spent), str(reply.budget_limit), str(reply.budget_held))
        need, field_name = f"{reply.budget_needed} tokens", "token_budget"
    what = (
        f"budget has {figures[0]} left ({figures[1]} spent of {figures[2]}, {figures[3]} reserved by requests in "
        f"flight) and this request may cost up to {need}"
    )
    period = " in this budget period" if retry_ms else ""
    owner, whose = (
        ("This API key's", "") if team_name is None else (f"This API key's team '{team_name}'", "the team's ")
    )
    return BudgetExceededError(
        f"{owner} {what}{period}. Lower max_tokens or n, wait for requests in flight, or ask the gateway "
        f"admin to raise {whose}`{field_name}`" + (" or wait for the budget period to reset." if retry_ms else "."),
        headers=_retry_after(retry_ms) if retry_ms else {},
    )
