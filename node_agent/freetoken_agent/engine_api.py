"""HTTP client for one engine's ``/health``, ``/admin/*`` and ``/metrics`` (docs/contracts.md).

Every call has a short timeout and raises ``EngineUnreachable`` for transport errors and
non-2xx answers (except ``health``, whose 503 bodies are meaningful and returned). The
admin token, when set, is sent as ``Authorization: Bearer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx


class EngineUnreachable(RuntimeError):
    """The engine did not answer, or answered with an error status."""


@dataclass(frozen=True)
class CacheInfo:
    """The fields of ``GET /admin/cache`` the agent uses."""

    capacity_bytes: int
    capacity_experts: int
    expert_bytes: int
    min_experts: int
    max_experts: int
    device: str
    device_bytes: int
    raw: dict

    @classmethod
    def from_body(cls, body: dict) -> "CacheInfo":
        try:
            ec = body["expert_cache"]
            return cls(capacity_bytes=int(ec["capacity_bytes"]),
                       capacity_experts=int(ec["capacity_experts"]),
                       expert_bytes=int(ec["expert_bytes"]), min_experts=int(ec["min_experts"]),
                       max_experts=int(ec["max_experts"]), device=str(body.get("device", "cpu")),
                       device_bytes=int(body.get("device_bytes", 0)), raw=body)
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineUnreachable(f"malformed /admin/cache body: {exc}") from exc


class EngineClient:
    def __init__(self, base_url: str, admin_token: str | None = None, timeout: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._headers = headers
        self._timeout = timeout
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _json(self, method: str, path: str, body: dict | None = None,
                    timeout: float | None = None) -> dict:
        try:
            resp = await self._client.request(method, path, json=body,
                                              timeout=timeout or self._timeout)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"{method} {path}: {exc!r}") from exc
        if resp.status_code // 100 != 2:
            raise EngineUnreachable(f"{method} {path}: HTTP {resp.status_code} {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineUnreachable(f"{method} {path}: not JSON") from exc

    async def health(self) -> tuple[int, dict]:
        """(status code, body). Connection failures raise ``EngineUnreachable``."""
        try:
            resp = await self._client.get("/health", timeout=2.0)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"GET /health: {exc!r}") from exc
        try:
            body = resp.json()
        except ValueError:
            body = {}
        return resp.status_code, body if isinstance(body, dict) else {}

    async def cache(self) -> CacheInfo:
        return CacheInfo.from_body(await self._json("GET", "/admin/cache", timeout=2.0))

    async def resize(self, expert_cache_bytes: int) -> CacheInfo:
        """Returns once the engine reports the new size in force (at its next safe point)."""
        body = await self._json("POST", "/admin/cache",
                                {"expert_cache_bytes": int(expert_cache_bytes)}, timeout=30.0)
        return CacheInfo.from_body(body)

    async def set_api_key(self, api_key: str) -> None:
        """The engine's inference key from now on (a rotated Secret); no restart."""
        await self._json("POST", "/admin/api-key", {"api_key": api_key}, timeout=5.0)

    async def calibrate(self, payload: dict, timeout: float = 300.0) -> dict:
        return await self._json("POST", "/admin/calibrate", payload, timeout=timeout)

    def metrics_text_sync(self, timeout: float = 2.0) -> str:
        """``GET /metrics`` from a scrape thread (prometheus-client collectors are synchronous)."""
        try:
            resp = httpx.get(self.base_url + "/metrics", headers=self._headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"GET /metrics: {exc!r}") from exc
        if resp.status_code != 200:
            raise EngineUnreachable(f"GET /metrics: HTTP {resp.status_code}")
        return resp.text
