"""The client address that authentication limits count under, and the connection's own address (the peer).

Behind a proxy the gateway trusts (`FORWARDED_ALLOW_IPS`, default `127.0.0.1`, read as uvicorn reads it), uvicorn's
proxy-headers middleware replaces the client address with the one `X-Forwarded-For` names and forgets the peer.
`ForwardedClientMiddleware` runs that same middleware but keeps the peer in the scope; `serve` installs it in place
of uvicorn's own (`gateway.server.uvicorn_config` turns that off). `client_address` then refuses a forwarded
"address" that is not an IP address (a 60,000-character header, a hostname, garbage): the peer stands in for it.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

__all__ = ["ClientAddress", "ForwardedClientMiddleware", "client_address", "forwarded_allow_ips"]

PEER_SCOPE_KEY = "unigate.peer"  # the connection's own (host, port), kept beside the forwarded `client`
_MAX_ADDRESS_CHARS = 45  # the longest textual IPv6 address (an IPv4-mapped one)


@dataclass(frozen=True, slots=True)
class ClientAddress:
    address: str  # the client: forwarded by a trusted proxy, else the peer
    peer: str  # the connection's own address: the proxy, when `address` was forwarded


def _ip(text: str) -> str | None:
    """`text` as a canonical IP address (so one address has one spelling), or None when it is not one."""
    if len(text) > _MAX_ADDRESS_CHARS:
        return None
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def forwarded_allow_ips() -> str:
    """The proxies whose `X-Forwarded-For` is trusted, as uvicorn reads them when it handles the headers itself."""
    return os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1")


class ForwardedClientMiddleware(ProxyHeadersMiddleware):
    """uvicorn's `ProxyHeadersMiddleware`, keeping the connection's own address in the scope."""

    def __init__(self, app: ASGIApp, trusted_hosts: str | list[str]) -> None:
        super().__init__(app, trusted_hosts)  # type: ignore[arg-type]  # uvicorn spells the ASGI types its own way

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        if scope["type"] != "lifespan":
            scope[PEER_SCOPE_KEY] = scope.get("client")
        await super().__call__(scope, receive, send)  # type: ignore[arg-type]


def client_address(request: Request) -> ClientAddress:
    """Who authentication limits count: the client address and the peer it came through. A client address that
    is not an IP address counts as the peer (as `unknown` when no middleware kept the peer)."""
    client = request.client.host if request.client is not None else None
    kept = request.scope.get(PEER_SCOPE_KEY)
    peer_host = str(kept[0]) if kept else client
    peer = (_ip(peer_host) if peer_host else None) or "unknown"
    address = _ip(client) if client is not None else None
    return ClientAddress(address=address or peer, peer=peer)
