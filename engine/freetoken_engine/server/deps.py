"""Per-request lookups shared by the routes: the ready service, the model name check, and the
start every generating route shares (``begin``)."""
from __future__ import annotations

import time

from fastapi import Request

from .errors import ApiError
from .generation import GenOptions, start_choices


def ready_service(request: Request, need_tokenizer: bool = True):
    """The EngineService, or 503 while it loads / after it failed (with Retry-After)."""
    svc = request.app.state.service
    health = svc.health()
    if health.get("status") == "ok":
        if need_tokenizer and svc.tokenizer is None:
            raise ApiError(400, "this model folder has no tokenizer (tokenizer.json or tiktoken.model); the HTTP "
                                "API needs one",
                           code="no_tokenizer")
        return svc
    if health.get("status") == "loading":
        pct = 100.0 * float(health.get("progress") or 0.0)
        raise ApiError(503, f"the model is still loading ({pct:.0f}%); retry shortly",
                       code="model_loading", headers={"Retry-After": "2"})
    raise ApiError(503, f"the engine failed to start: {health.get('error')}", code="engine_error")


def served_name(request: Request) -> str:
    cfg = request.app.state.config
    return cfg.served_model_name or request.app.state.service.model_name


def check_model(request: Request, model: str) -> None:
    name = served_name(request)
    if model != name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{name}' "
                            "(see GET /v1/models)", param="model", code="model_not_found")


def begin(request: Request, body, endpoint: str, prompt_of, options: GenOptions):
    """Check the service, the model and the body's parameters, render the prompt with
    ``prompt_of(service, body)`` and submit it: ``(service, prompt, generation)``."""
    svc, prompt, gens = begin_choices(request, body, endpoint, prompt_of, options, 1)
    return svc, prompt, gens[0]


def begin_choices(request: Request, body, endpoint: str, prompt_of, options: GenOptions, n: int):
    """``begin`` for ``n`` choices of one prompt: ``(service, prompt, Choices)``."""
    t0 = time.monotonic()
    svc = ready_service(request)
    check_model(request, body.model)
    body.check_supported()
    prompt = prompt_of(svc, body)
    return svc, prompt, start_choices(svc, prompt, options, n, metrics=request.app.state.metrics,
                                      endpoint=endpoint, t_arrival=t0)
