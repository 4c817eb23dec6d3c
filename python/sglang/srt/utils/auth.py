"""Bearer-key authentication of the HTTP routes (upstream's ``srt/utils/auth.py`` names).

Each endpoint carries an ``AuthLevel`` (``@auth_level(...)``, default ``NORMAL``);
``decide_request_auth`` is the pure decision and ``add_api_key_middleware`` applies it to every
HTTP request before routing:

- ``NORMAL`` (inference and info routes): ``--api-key`` when set, else open (also when only
  ``--admin-api-key`` is set), as upstream.
- ``ADMIN_OPTIONAL`` (upstream's level, kept for its routes): the admin key when set, else the
  api key when set, else open.
- ``ADMIN_FORCE`` (every route that changes or reveals the cache or storage here): the admin key
  only; refused with 403 when the server has no admin key, whatever the request sends. Upstream
  leaves its storage routes open when no key is configured; this server does not.

An empty key counts as unset (upstream's truthiness). ``/health*``, ``/ready*`` and
``/metrics*`` are always open (probes and scrapers carry no secret), as upstream. Keys are
compared in constant time, as bytes (a non-ASCII header cannot raise). Refusals use the
server's error shape: 401 (``WWW-Authenticate: Bearer``) for a missing or wrong key, 403 when
the route cannot be unlocked; the message never holds a key.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any

OPEN_PREFIXES = ("/health", "/ready", "/metrics")


class AuthLevel(str, Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


@dataclass(frozen=True)
class AuthDecision:
    allowed: bool
    error_status_code: int = 401  # meaningful only when not allowed
    message: str = ""


def auth_level(level: AuthLevel):
    """Mark an endpoint function with ``level`` (read by the middleware)."""

    def decorator(func):
        func._auth_level = level
        return func

    return decorator


def _bearer_matches(authorization_header: str | None, expected: str) -> bool:
    if not authorization_header:
        return False
    scheme, _, token = authorization_header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        sent = token.encode("latin-1")  # the header's own bytes (ASGI headers are bytes, decoded latin-1)
    except UnicodeEncodeError:
        sent = token.encode("utf-8")
    return secrets.compare_digest(sent, expected.encode("utf-8"))


_NO_ADMIN_KEY = ("this route needs the admin API key, and the server was started without one; "
                 "restart with --admin-api-key to enable it")


def _key_check(header: str | None, key: str, flag: str) -> AuthDecision:
    if _bearer_matches(header, key):
        return AuthDecision(True)
    return AuthDecision(False, 401, f"missing or wrong API key: send 'Authorization: Bearer <{flag}>'")


def decide_request_auth(*, method: str, path: str, authorization_header: str | None, api_key: str | None,
                        admin_api_key: str | None, auth_level: AuthLevel) -> AuthDecision:
    """Whether a request may reach its endpoint (see the module docstring for the rules)."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return AuthDecision(True)
    if auth_level is AuthLevel.ADMIN_FORCE:
        if not admin_api_key:
            return AuthDecision(False, 403, _NO_ADMIN_KEY)
        return _key_check(authorization_header, admin_api_key, "--admin-api-key")
    if auth_level is AuthLevel.ADMIN_OPTIONAL:
        if admin_api_key:
            return _key_check(authorization_header, admin_api_key, "--admin-api-key")
        if api_key:
            return _key_check(authorization_header, api_key, "--api-key")
        return AuthDecision(True)
    if api_key:
        return _key_check(authorization_header, api_key, "--api-key")
    return AuthDecision(True)


def route_auth_level(app: Any, scope: dict) -> AuthLevel:
    """The level of the endpoint ``scope`` fully matches (method included); ``NORMAL`` when none
    does (the router then answers 404 / 405)."""
    from starlette.routing import Match

    for route in app.router.routes:
        match, child_scope = route.matches(scope)
        if match is Match.FULL:
            endpoint = child_scope.get("endpoint") or getattr(route, "endpoint", None)
            level = getattr(endpoint, "_auth_level", None)
            return level if isinstance(level, AuthLevel) else AuthLevel.NORMAL
    return AuthLevel.NORMAL


def add_api_key_middleware(app, *, api_key: str | None, admin_api_key: str | None) -> None:
    """Check every HTTP request of ``app`` before it is routed (an ASGI middleware, so streaming
    responses and client-disconnect events pass through untouched)."""
    from fastapi.responses import JSONResponse

    class _ApiKeyASGIMiddleware:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                await self.inner(scope, receive, send)
                return
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)
            decision = decide_request_auth(method=scope["method"], path=scope["path"], authorization_header=header,
                                           api_key=api_key, admin_api_key=admin_api_key,
                                           auth_level=route_auth_level(app, scope))
            if decision.allowed:
                await self.inner(scope, receive, send)
                return
            status = decision.error_status_code
            kind = "Unauthorized" if status == 401 else "Forbidden"
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            response = JSONResponse({"error": {"message": decision.message, "type": kind, "code": status}},
                                    status_code=status, headers=headers)
            await response(scope, receive, send)

    app.add_middleware(_ApiKeyASGIMiddleware)
