"""The operator console: its static files under `/ui` and its session endpoints under `/ui/api/`.

The console is a static single-page app (`gateway/ui/`, plus the shared `bench/static/charts.js`) that calls the
same `/admin/...` JSON API as the CLI. The browser never holds the master key after login: `POST /ui/api/login`
checks it once and sets the `unigate_session` cookie (HttpOnly, SameSite=Strict, Secure over https), whose
record lives in Redis (`auth.sessions`). Every state-changing call with that cookie must carry the session's
CSRF token in `x-csrf-token` and, when the browser sends one, an `Origin` of this host (`require_session`, which
the admin routes call). Every `/ui` response, errors included, carries a strict Content-Security-Policy.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.resources
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from auth.master_key import read_master_key
from auth.sessions import AuthLimiter, AuthWindow, Session, SessionStore
from gateway.client_address import client_address
from gateway.errors import (
    AuthError,
    GatewayError,
    InvalidRequestError,
    LimitError,
    NotFoundError,
    PermissionDeniedError,
)
from gateway.security_headers import SECURITY_HEADERS
from gateway.settings import Settings

__all__ = [
    "SECURITY_HEADERS",
    "SESSION_COOKIE",
    "auth_limiter",
    "console_routes",
    "has_session_cookie",
    "require_session",
    "too_many_attempts",
]

SESSION_COOKIE = "unigate_session"
CSRF_HEADER = "x-csrf-token"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
_STATIC_NAME = re.compile(r"^[a-z0-9_-]{1,64}\.(js|css|svg)$")
_SHARED_FILES = {"charts.js": ("bench", "static/charts.js")}  # served from another package (dependency arrow ok)
_MAX_LOGIN_BODY = 4096
_PEER_LIMIT_FACTOR = 10  # a trusted proxy may forward this many times one address's attempts per minute

Handler = Callable[[Request], Awaitable[Response]]


def _read_file(package: str, name: str) -> bytes | None:
    try:
        return importlib.resources.files(package).joinpath(name).read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _static_file(name: str) -> bytes | None:
    package, path = _SHARED_FILES.get(name, ("gateway", f"ui/{name}"))
    return _read_file(package, path)


def _secured(handler: Handler, methods: tuple[str, ...] | None = None) -> Handler:
    """Add the security headers to the handler's response, and to the error it raises (rendered further out). The
    route takes every method and a method not in `methods` is refused here (405), so that refusal carries the
    headers too (Starlette's own 405 is rendered before any handler runs)."""
    allowed = None if methods is None else frozenset(methods) | ({"HEAD"} if "GET" in methods else set())

    async def wrapped(request: Request) -> Response:
        try:
            if allowed is not None and request.method not in allowed:
                raise GatewayError(
                    f"{request.method} is not allowed on {request.url.path}.",
                    code="method_not_allowed",
                    status_code=405,
                    headers={"allow": ", ".join(sorted(allowed))},
                )
            response = await handler(request)
        except GatewayError as error:
            error.headers.update(SECURITY_HEADERS)
            error.headers.setdefault("cache-control", "no-store")
            raise
        response.headers.update(SECURITY_HEADERS)
        return response

    return wrapped


def _file_response(request: Request, name: str) -> Response:
    content = _static_file(name)
    if content is None:
        raise NotFoundError(f"The console has no file {name!r}.", code="not_found")
    etag = '"' + hashlib.sha256(content).hexdigest()[:32] + '"'
    headers = {"etag": etag, "cache-control": "no-cache"}  # revalidate: a new release shows at once
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    suffix = name[name.rfind(".") :]
    return Response(content, headers=headers, media_type=_MEDIA_TYPES[suffix])


async def index(request: Request) -> Response:
    return _file_response(request, "index.html")


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if not _STATIC_NAME.match(name):
        raise NotFoundError(f"The console has no file {name!r}.", code="not_found")
    return _file_response(request, name)


def _json(data: dict[str, Any], status_code: int = 200) -> Response:
    return Response(
        orjson.dumps(data),
        status_code=status_code,
        media_type="application/json",
        headers={"cache-control": "no-store"},
    )


def _sessions(request: Request) -> SessionStore:
    """The app's session store (over the key store's Redis); 404 when this app serves no admin API."""
    state = request.app.state
    store: SessionStore | None = getattr(state, "console_sessions", None)
    if store is None:
        key_store = getattr(state, "key_store", None)
        if key_store is None:
            raise NotFoundError(
                "This gateway serves no admin API, so the console cannot log in (start it with `unigate serve`).",
                code="not_found",
            )
        settings: Settings = state.settings
        store = state.console_sessions = SessionStore(key_store.redis, ttl_s=settings.console.session_ttl_s)
    return store


def auth_limiter(request: Request) -> AuthLimiter:
    """The app's limiter of master-key guesses: console logins and failed admin authentications share its windows
    (`UNIGATE_CONSOLE__MAX_LOGINS_PER_MIN` per client address, ten times that per trusted proxy)."""
    state = request.app.state
    limiter: AuthLimiter | None = getattr(state, "auth_limiter", None)
    if limiter is None:
        max_per_min = state.settings.console.max_logins_per_min
        limiter = state.auth_limiter = AuthLimiter(
            _sessions(request).redis, max_per_min=max_per_min, max_per_peer_per_min=_PEER_LIMIT_FACTOR * max_per_min
        )
    return limiter


def too_many_attempts(window: AuthWindow) -> LimitError:
    return LimitError(
        f"Too many login attempts or wrong master keys from this address; retry in {window.retry_after_s} s.",
        code="rate_limit_exceeded",
        headers={"retry-after": str(window.retry_after_s)},
    )


def _master_key(request: Request) -> str | None:
    master_key: str | None = getattr(request.app.state, "master_key", None)
    if master_key is not None:
        return master_key
    settings: Settings = request.app.state.settings
    configured = settings.master_key.get_secret_value() if settings.master_key is not None else None
    return read_master_key(configured, settings.data_dir)


def _check_origin(request: Request) -> None:
    """A browser's `Origin`, when sent, must name this host (`Host`, or `X-Forwarded-Host` behind a proxy)."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    hosts = {request.headers.get("host", ""), request.headers.get("x-forwarded-host", "")} - {""}
    if urlsplit(origin).netloc not in hosts:
        raise PermissionDeniedError(
            "Cross-origin request refused: the console only accepts calls from its own pages.", code="csrf_failed"
        )


def has_session_cookie(request: Request) -> bool:
    return SESSION_COOKIE in request.cookies


async def require_session(request: Request, *, is_state_changing: bool) -> Session:
    """The console session of this request's cookie: 401 `session_expired` when it has ended (logout, expiry, a
    new master key); for a state-changing call also the CSRF token and Origin, else 403 `csrf_failed`."""
    master_key = _master_key(request)
    session_id = request.cookies.get(SESSION_COOKIE, "")
    session = await _sessions(request).get(session_id, master_key) if master_key else None
    if session is None:
        raise AuthError("Your console session has ended; log in again with the master key.", code="session_expired")
    if is_state_changing:
        _check_origin(request)
        token = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(token.encode(), session.csrf_token.encode()):
            raise PermissionDeniedError(
                f"Missing or wrong {CSRF_HEADER} header: state-changing console calls must send the session's "
                "CSRF token (reload the console).",
                code="csrf_failed",
            )
    return session


def _session_json(session: Session) -> dict[str, Any]:
    return {"object": "console_session", "csrf_token": session.csrf_token, "expires_in_s": session.expires_in_s}


async def login(request: Request) -> Response:
    """`POST /ui/api/login` `{"master_key": "..."}` → the session cookie and its CSRF token."""
    _check_origin(request)
    store = _sessions(request)
    client = client_address(request)
    window = await auth_limiter(request).count(client.address, client.peer)  # right or wrong, every login counts
    if window.is_blocked:
        raise too_many_attempts(window)
    raw = await request.body()
    try:
        body = orjson.loads(raw) if len(raw) <= _MAX_LOGIN_BODY else None
    except orjson.JSONDecodeError:
        body = None
    offered = body.get("master_key") if isinstance(body, dict) else None
    if not isinstance(offered, str) or not offered:
        raise InvalidRequestError('Send a JSON body {"master_key": "..."}.', param="master_key")
    master_key = _master_key(request)
    if master_key is None or not hmac.compare_digest(offered.encode(), master_key.encode()):
        raise AuthError("Wrong master key.", code="invalid_api_key")
    session = await store.create(master_key)
    response = _json(_session_json(session))
    response.set_cookie(
        SESSION_COOKIE,
        session.id,
        max_age=session.expires_in_s,
        path="/",
        secure=request.url.scheme == "https",
        httponly=True,
        samesite="strict",
    )
    return response


async def current_session(request: Request) -> Response:
    """`GET /ui/api/session`: the session's CSRF token and remaining lifetime (a reloaded page asks here)."""
    return _json(_session_json(await require_session(request, is_state_changing=False)))


async def logout(request: Request) -> Response:
    """`POST /ui/api/logout`: ends the session everywhere (its Redis record is deleted) and clears the cookie."""
    if has_session_cookie(request):
        try:
            session: Session | None = await require_session(request, is_state_changing=True)
        except AuthError:  # already ended: only the cookie is left to clear
            session = None
        if session is not None:
            await _sessions(request).delete(session.id)
    response = _json({"object": "console_session", "ended": True})
    response.delete_cookie(
        SESSION_COOKIE, path="/", secure=request.url.scheme == "https", httponly=True, samesite="strict"
    )
    return response


async def unknown(request: Request) -> Response:
    raise NotFoundError(f"The console has no page {request.url.path!r}; open /ui.", code="not_found")


# Every route under /ui takes any method and refuses the wrong ones itself (`_secured`).
_ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def console_routes() -> list[Route]:
    return [
        Route("/ui", _secured(index, ("GET",)), methods=_ANY_METHOD),
        Route("/ui/", _secured(index, ("GET",)), methods=_ANY_METHOD),  # a route of its own, not a rewrite
        Route("/ui/static/{name}", _secured(static, ("GET",)), methods=_ANY_METHOD),
        Route("/ui/api/login", _secured(login, ("POST",)), methods=_ANY_METHOD),
        Route("/ui/api/session", _secured(current_session, ("GET",)), methods=_ANY_METHOD),
        Route("/ui/api/logout", _secured(logout, ("POST",)), methods=_ANY_METHOD),
        Route("/ui/{rest:path}", _secured(unknown), methods=_ANY_METHOD),  # every /ui response carries the headers
    ]
