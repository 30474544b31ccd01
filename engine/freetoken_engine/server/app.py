"""The FastAPI application: ``create_app(service, config)``.

The app holds an ``EngineService`` (``app.state.service``; see docs/contracts.md), a
``ServerConfig`` and its own ``EngineMetrics`` registry. It never loads a model itself, so tests
can build any number of apps. ``_Accounting`` is a pure ASGI middleware (it does not buffer
streams): it counts every response by endpoint and status and rejects bodies over
``max_body_bytes`` with 413 before they are read.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..errors import ConfigError
from ..metrics import EngineMetrics
from . import admin, anthropic_api, errors, openai_api, responses_api


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings; the engine's own settings live in the lead's EngineConfig."""

    api_key: str | None = None
    admin_token: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 64 << 20
    #: a stream silent this long (a long prompt's prefill) gets a heartbeat: Anthropic's ``ping``
    #: event, an SSE comment elsewhere; proxies and agents then keep waiting
    heartbeat_s: float = 10.0

    def __post_init__(self):
        for name in ("api_key", "admin_token", "served_model_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"--{name.replace('_', '-')} must be a non-empty string")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be an integer >= 1024")
        if not self.heartbeat_s > 0:
            raise ConfigError("heartbeat_s must be > 0")


class _Accounting:
    def __init__(self, app, metrics: EngineMetrics, max_body: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        length = dict(scope.get("headers") or ()).get(b"content-length", b"0")
        try:
            too_big = int(length) > self.max_body
        except ValueError:
            too_big = False
        if too_big:
            body = errors.error_body(path, 413, f"request body over {self.max_body} bytes")
            self.metrics.observe_request(path, 413)
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                self.metrics.observe_request(path, message["status"])
            await send(message)
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if status["code"] == 500:
                self.metrics.observe_request(path, 500)
            raise


def create_app(service, config: ServerConfig | None = None) -> FastAPI:
    """Build the app around a started (possibly still loading) EngineService."""
    config = config or ServerConfig()
    app = FastAPI(title="FreeToken engine", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = EngineMetrics(service, config.served_model_name or "")
    app.state.service, app.state.config, app.state.metrics = service, config, metrics
    app.state.started = time.time()
    errors.install(app)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(admin.router)
    app.include_router(admin.public)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        return Response(request.app.state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    app.add_middleware(_Accounting, metrics=metrics, max_body=config.max_body_bytes)
    return app
