"""Every error the HTTP layer answers, mapped in one place.

``ApiError`` is the server's own vocabulary (auth, unknown model, unsupported parameter);
``freetoken_engine.errors.EngineError`` subclasses carry their own ``http_status``. ``install``
registers one handler per exception family on the app. The body shape follows the route:
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` everywhere else. Nothing a client sends is
answered with a 500: request validation is 400 (422 on admin routes, as the contract says).
"""
from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import EngineError, QueueFull

log = logging.getLogger(__name__)

_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


class ApiError(Exception):
    """An HTTP error with a message that says what to fix."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _encodable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """The JSON error body for ``path`` (also used for errors inside an SSE stream). Text that
    echoes the request (a model name, a parameter) may hold lone surrogates, which JSON parses
    but UTF-8 cannot encode: they are written as ``\\udXXX`` escapes, not turned into a 500."""
    message = _encodable(message)
    param = None if param is None else _encodable(param)
    if is_anthropic(path):
        return {"type": "error",
                "error": {"type": _ANTHROPIC_TYPE.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _OPENAI_TYPE.get(status, "server_error"),
                      "param": param, "code": code}}


def _respond(request: Request, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, err.status, err.message, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def from_engine(exc: EngineError) -> ApiError:
    status = int(getattr(exc, "http_status", 500))
    headers = {}
    if isinstance(exc, QueueFull):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return ApiError(status, str(exc) or type(exc).__name__, code=getattr(exc, "code", None),
                    headers=headers)


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[str, str | None]:
    parts, first = [], None
    for e in exc.errors()[:5]:
        if e.get("type") == "json_invalid":
            return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', '')})", None
        if tuple(e.get("loc", ())) == ("body",) and content_type and "json" not in content_type:
            # curl -d sends application/x-www-form-urlencoded: the body was never read as JSON
            return (f"the request body must be JSON sent with 'Content-Type: application/json' "
                    f"(got {content_type!r})"), None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        first = first or where
        parts.append(f"{where}: {e.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request body", first


def install(app: FastAPI) -> None:
    """Register the exception handlers (the only place HTTP statuses are chosen for errors)."""

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return _respond(request, exc)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        return _respond(request, from_engine(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        status = 422 if request.url.path.startswith("/admin") else 400
        message, param = _validation_message(exc, request.headers.get("content-type", ""))
        return _respond(request, ApiError(status, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return _respond(request, ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return _respond(request, ApiError(500, f"internal error: {type(exc).__name__}"))
