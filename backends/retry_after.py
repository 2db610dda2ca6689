"""An upstream's `Retry-After`, read defensively (RFC 9110 section 10.2.3: delay-seconds or an HTTP-date).

Anything else — `nan`, `inf`, `-5`, `1e3`, `soon`, a malformed date — is None, so callers fall back to their
default cooldown instead of taking a deployment out of rotation for ever. Callers bound the result themselves
(the router clamps it to `router.max_retry_after_s`).
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC
from email.utils import parsedate_to_datetime

__all__ = ["parse_retry_after", "retry_after_header"]

# delay-seconds is 1*DIGIT; a fraction is tolerated because some servers send one.
_SECONDS = re.compile(r"[0-9]{1,12}(\.[0-9]{1,6})?")


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait (finite, >= 0), or None when `value` is absent or not a valid Retry-After.
    `now` (epoch seconds, default the wall clock) is what an HTTP-date is measured from."""
    if value is None:
        return None
    text = value.strip()
    if _SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": RFC 9110 dates are always GMT
        when = when.replace(tzinfo=UTC)
    delay = when.timestamp() - (time.time() if now is None else now)
    return max(delay, 0.0) if math.isfinite(delay) else None


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, as a `Retry-After` value for our own clients."""
    return str(math.ceil(seconds))
