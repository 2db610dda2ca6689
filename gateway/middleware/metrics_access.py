"""Guard `GET /metrics` when the operator asks to: a bearer token (`UNIGATE_METRICS_TOKEN`: 401 without it) and/or
allowed client networks (`UNIGATE_METRICS_ALLOW`: 403 from elsewhere). Unset, /metrics stays open (the
label sets are bounded either way: gateway/metrics.py)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import AuthError, PermissionDeniedError

__all__ = ["METRICS_PATH", "MetricsAccessMiddleware"]

METRICS_PATH = "/metrics"


class MetricsAccessMiddleware:
    def __init__(self, app: ASGIApp, *, token: str | None, networks: Sequence[str]) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.networks: list[IPv4Network | IPv6Network] = [ip_network(n, strict=False) for n in networks]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (self.token is not None or self.networks) and _route_path(scope) == METRICS_PATH:
            self.check(scope)
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> None:
        """Network first: a caller from outside learns nothing about the token."""
        if self.networks and not self._is_allowed_client(scope.get("client")):
            raise PermissionDeniedError(
                "/metrics is not served to this network (UNIGATE_METRICS_ALLOW).", code="metrics_forbidden"
            )
        if self.token is not None and not self._has_token(scope["headers"]):
            raise AuthError(
                "/metrics needs 'Authorization: Bearer <token>' with the metrics token (UNIGATE_METRICS_TOKEN).",
                code="metrics_forbidden",
                headers={"www-authenticate": "Bearer"},
            )

    def _is_allowed_client(self, client: object) -> bool:
        if not isinstance(client, tuple | list) or not client or not isinstance(client[0], str):
            return False  # no peer address (e.g. a unix socket): not provably from an allowed network
        try:
            address = ip_address(client[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.1 on a dual-stack socket is 10.0.0.1
        return any(address in network or (mapped is not None and mapped in network) for network in self.networks)

    def _has_token(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        assert self.token is not None
        for name, value in headers:
            if name == b"authorization":
                scheme, _, credential = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self.token)
        return False


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    return path[len(root_path) :] if root_path and path.startswith(root_path) else path
