"""API-key and admin authorization, as FastAPI dependencies.

- Inference routes (``/v1/*``): when the server has an API key, the request must carry it as
  ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (the OpenAI and Anthropic clients send one
  of these); otherwise 401.
- Admin routes (``/admin/*``): with an admin token, ``Authorization: Bearer TOKEN`` is required
  (401 without credentials, 403 with wrong ones); without one, only loopback clients are served
  (403 for anyone else). Keys are compared in constant time.
"""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from .errors import ApiError


def _presented(request: Request) -> list[str]:
    out = []
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        out.append(auth[7:].strip())
    key = request.headers.get("x-api-key")
    if key:
        out.append(key.strip())
    return out


def _matches(given: list[str], secret: str) -> bool:
    return any(hmac.compare_digest(g.encode(), secret.encode()) for g in given)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a client's or a bind address) is this machine only."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def require_api_key(request: Request) -> None:
    secret = request.app.state.config.api_key
    if not secret:
        return
    given = _presented(request)
    if not given:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                       code="invalid_api_key")
    if not _matches(given, secret):
        raise ApiError(401, "invalid API key", code="invalid_api_key")


async def require_admin(request: Request) -> None:
    token = request.app.state.config.admin_token
    if token:
        given = _presented(request)
        if not given:
            raise ApiError(401, "admin endpoints need 'Authorization: Bearer ADMIN_TOKEN'",
                           code="invalid_admin_token")
        if not _matches(given, token):
            raise ApiError(403, "wrong admin token", code="invalid_admin_token")
        return
    client = request.client.host if request.client else None
    if not is_loopback(client):
        raise ApiError(403, "admin endpoints accept only loopback clients when the server "
                            "runs without --admin-token", code="forbidden")
