"""Bearer-token checks, as FastAPI dependencies (so the OpenAPI schema declares them).

- :func:`require_write` guards every mutating endpoint (every POST): the token must match; with no
  token configured mutations are refused (403) unless ``allow_insecure_loopback_writes`` is set
  and the client is on loopback.
- :func:`require_read` guards reading endpoints only when ``settings.reads_need_token`` (by default:
  when the server listens on a non-loopback address).

Tokens are compared in constant time. Never: logs a token, or accepts one from a query string.
"""

from __future__ import annotations

import hmac

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from server.errors import AuthError
from server.settings import ENV_TOKEN, Settings, is_loopback

__all__ = ["bearer", "require_write", "require_read", "token_matches"]

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="bearerToken",
    description=f"The server's token (`swiftlog serve --token`, or {ENV_TOKEN}).",
)


def _check_token(settings: Settings, creds: HTTPAuthorizationCredentials | None) -> None:
    assert settings.token is not None
    if creds is None or not creds.credentials:
        raise AuthError("missing bearer token", status=401, hint="send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(creds.credentials.encode(), settings.token.get_secret_value().encode()):
        raise AuthError("invalid bearer token", status=401, hint="use the token the server was started with")


async def require_write(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Allow a mutating request, or raise AuthError (401 bad/missing token, 403 mutations disabled)."""
    settings: Settings = request.app.state.settings
    if settings.token is not None:
        _check_token(settings, creds)
        return
    client = request.client.host if request.client else ""
    if settings.allow_insecure_loopback_writes and is_loopback(client):
        return
    raise AuthError(
        "mutating endpoints are disabled: this server has no token",
        status=403,
        hint=f"restart with --token (or {ENV_TOKEN}); for local development only, --allow-insecure-loopback-writes",
    )


async def require_read(request: Request, creds: HTTPAuthorizationCredentials | None = Security(bearer)) -> None:
    """Allow a reading request; only installed when reads need the token."""
    _check_token(request.app.state.settings, creds)


def token_matches(settings: Settings, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header value carries the server's token, read as
    :func:`require_read` reads it (HTTPBearer's parsing, a constant-time comparison). For what
    answers a request before FastAPI's dependencies run. Never raises; False without a token."""
    scheme, credentials = get_authorization_scheme_param(authorization)
    if settings.token is None or not (authorization and scheme and credentials) or scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(credentials.encode(), settings.token.get_secret_value().encode())
