"""Anthropic wire metadata: rate-limit headers in Anthropic's naming and the model list Anthropic clients expect."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

__all__ = ["anthropic_headers", "anthropic_model_list"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def anthropic_headers(headers: dict[str, str], *, request_id: str, now: float | None = None) -> dict[str, str]:
    """The call's headers plus Anthropic's names for them: `request-id`, and `anthropic-ratelimit-*` (limits and
    remaining counts as they are; OpenAI-style reset durations such as `6m0s` as RFC 3339 times)."""
    result = {**headers, "request-id": request_id}
    now = time.time() if now is None else now
    for kind in ("requests", "tokens"):
        for field in ("limit", "remaining"):
            value = headers.get(f"x-ratelimit-{field}-{kind}")
            if value is not None:
                result[f"anthropic-ratelimit-{kind}-{field}"] = value
        reset = headers.get(f"x-ratelimit-reset-{kind}")
        if reset is not None:
            seconds = sum(float(amount) * _UNIT_S[unit] for amount, unit in _DURATION.findall(reset))
            at = datetime.fromtimestamp(now + seconds, tz=UTC).replace(microsecond=0)
            result[f"anthropic-ratelimit-{kind}-reset"] = at.isoformat().replace("+00:00", "Z")
    return result


def anthropic_model_list(model_ids: list[str], *, created: float) -> dict[str, Any]:
    """`GET /v1/models` in the shape Anthropic clients expect (for the OpenAI route to answer with when the
    request carries an `anthropic-version` header)."""
    created_at = datetime.fromtimestamp(created, tz=UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    data = [
        {"type": "model", "id": i, "display_name": i, "created_at": created_at, "lifecycle": "active"}
        for i in model_ids
    ]
    return {
        "data": data,
        "has_more": False,
        "first_id": model_ids[0] if model_ids else None,
        "last_id": model_ids[-1] if model_ids else None,
    }
