"""Admin routes (``/admin/cache``, ``/admin/calibrate``, ``/admin/api-key``) and the
unauthenticated ``/health``.

Admin access is checked by ``auth.require_admin``. A body that is not one of the documented
shapes is a 422 with a message naming the accepted shapes (the node agent reads it in logs).
"""
from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .auth import require_admin
from .deps import ready_service, served_name

router = APIRouter(dependencies=[Depends(require_admin)])
public = APIRouter()


class CacheResize(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    expert_cache_bytes: int | None = Field(None, ge=0)
    expert_cache_experts: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.expert_cache_bytes is None) == (self.expert_cache_experts is None):
            raise ValueError("send exactly one of {'expert_cache_bytes': N} or "
                             "{'expert_cache_experts': N}")
        return self


class Calibrate(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    measure: bool | None = None
    pcie_gbps: float | None = Field(None, gt=0)
    cpu_expert_gbps: float | None = Field(None, gt=0)
    fill_fraction: float | None = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_shape(self):
        bw = self.pcie_gbps is not None or self.cpu_expert_gbps is not None
        shapes = [bool(self.measure), bw, self.fill_fraction is not None]
        if sum(shapes) != 1:
            raise ValueError("send one of {'measure': true}, {'pcie_gbps': X, "
                             "'cpu_expert_gbps': Y} or {'fill_fraction': F}")
        return self


class ApiKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    api_key: str = Field(min_length=1, max_length=4096, pattern=r"^\S+$")


@public.get("/health")
async def health(request: Request):
    h = request.app.state.service.health()
    status = h.get("status")
    if status == "ok":
        return {"status": "ok", "model": served_name(request)}
    if status == "loading":
        return JSONResponse({"status": "loading", "progress": float(h.get("progress") or 0.0)},
                            status_code=503)
    return JSONResponse({"status": "error", "error": str(h.get("error"))}, status_code=503)


@router.get("/admin/cache")
async def get_cache(request: Request):
    return ready_service(request, need_tokenizer=False).cache_stats()


@router.post("/admin/cache")
async def resize_cache(body: CacheResize, request: Request):
    svc = ready_service(request, need_tokenizer=False)
    return await svc.resize_expert_cache(experts=body.expert_cache_experts,
                                         bytes=body.expert_cache_bytes)


@router.post("/admin/calibrate")
async def calibrate(body: Calibrate, request: Request):
    svc = ready_service(request, need_tokenizer=False)
    # the service waits for a scheduler safe point (and measuring takes seconds): run it off
    # the event loop so streams keep flowing meanwhile
    if body.measure:
        return await asyncio.to_thread(svc.calibrate, measure=True)
    if body.fill_fraction is not None:
        return await asyncio.to_thread(svc.calibrate, fill_fraction=body.fill_fraction)
    return await asyncio.to_thread(svc.calibrate, pcie_gbps=body.pcie_gbps,
                                   cpu_expert_gbps=body.cpu_expert_gbps)


@router.post("/admin/api-key")
async def set_api_key(body: ApiKey, request: Request):
    """Replace the inference API key now (a rotated Secret, pushed by the node agent): requests
    from then on need the new key; streams already running go on. A key can be set or changed,
    never removed. The key is not echoed or logged."""
    request.app.state.config = dataclasses.replace(request.app.state.config, api_key=body.api_key)
    return {"api_key": "set"}
