"""Operator configuration: one frozen dataclass, validated once; the only module reading env vars.

Environment variables (each also a ``freetoken-operator`` flag, the flag wins):

- ``FREETOKEN_OPERATOR_STALE_SECONDS`` (30): a FreeTokenNode whose heartbeat has not changed for
  this long is lost; its replicas move to healthy nodes.
- ``FREETOKEN_OPERATOR_KUBE_SERVER`` (unset): plain-HTTP API server URL (tests: kmock); unset
  means in-cluster config, then the kubeconfig.
- ``FREETOKEN_OPERATOR_RESYNC_SECONDS`` (1.0): reconcile tick, so staleness is noticed without events.
- ``FREETOKEN_OPERATOR_BASE_PORT`` (1919): first engine port handed out on a node.
- ``FREETOKEN_OPERATOR_API_TIMEOUT_SECONDS`` (30): the longest one write to the API server may
  take (connect and read); a call past it fails the pass, which is retried, instead of holding
  the reconcile loop (and the operator's shutdown) on a connection that never answers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

ENV_STALE = "FREETOKEN_OPERATOR_STALE_SECONDS"
ENV_KUBE_SERVER = "FREETOKEN_OPERATOR_KUBE_SERVER"
ENV_RESYNC = "FREETOKEN_OPERATOR_RESYNC_SECONDS"
ENV_BASE_PORT = "FREETOKEN_OPERATOR_BASE_PORT"
ENV_API_TIMEOUT = "FREETOKEN_OPERATOR_API_TIMEOUT_SECONDS"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Validated operator settings. Raises ConfigError on construction when a value is bad."""

    stale_seconds: float = 30.0
    kube_server: str | None = None
    resync_seconds: float = 1.0
    base_port: int = 1919
    api_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not self.stale_seconds > 0:
            raise ConfigError(f"stale_seconds must be > 0, got {self.stale_seconds!r}")
        if not self.resync_seconds > 0:
            raise ConfigError(f"resync_seconds must be > 0, got {self.resync_seconds!r}")
        if not 0 < self.api_timeout_seconds <= 600:
            raise ConfigError(f"api_timeout_seconds must be in (0, 600], got {self.api_timeout_seconds!r}")
        if not 1 <= self.base_port <= 65535:
            raise ConfigError(f"base_port must be in 1..65535, got {self.base_port!r}")
        if self.kube_server is not None and not self.kube_server.startswith(("http://", "https://")):
            raise ConfigError(f"kube_server must be an http(s) URL, got {self.kube_server!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> "OperatorConfig":
        """Build from environment variables; keyword overrides that are not None win."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        try:
            if env.get(ENV_STALE):
                values["stale_seconds"] = float(env[ENV_STALE])
            if env.get(ENV_RESYNC):
                values["resync_seconds"] = float(env[ENV_RESYNC])
            if env.get(ENV_BASE_PORT):
                values["base_port"] = int(env[ENV_BASE_PORT])
            if env.get(ENV_API_TIMEOUT):
                values["api_timeout_seconds"] = float(env[ENV_API_TIMEOUT])
        except ValueError as exc:
            raise ConfigError(f"bad numeric environment value: {exc}") from exc
        if env.get(ENV_KUBE_SERVER):
            values["kube_server"] = env[ENV_KUBE_SERVER]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
