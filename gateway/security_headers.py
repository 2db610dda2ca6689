"""The console's security headers, in a module of their own so that the HTTP protocol layer (`gateway.http_limits`,
which answers before any route is known) can send them without importing the web routes."""

from __future__ import annotations

__all__ = ["SECURITY_HEADERS"]

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}
