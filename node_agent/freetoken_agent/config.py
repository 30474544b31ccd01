"""The agent's configuration: one frozen dataclass, and every environment variable it reads.

The command line (docs/contracts.md) sets the common options; the knobs that tests and
operators rarely touch come from the environment, all declared in ``ENV`` below. ``from_env``
validates once, at the edge, and raises ``ConfigError`` with the variable's name.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from .policy import PolicyConfig

# name -> what it sets. The only place the agent reads os.environ.
ENV = {
    "NODE_NAME": "default for --node-name (the DaemonSet sets it from spec.nodeName)",
    "NODE_IP": "default for --address (the DaemonSet sets it from status.hostIP)",
    "FREETOKEN_AGENT_ENGINE_COMMAND": "engine command prefix, shell-split "
                                      "(default: this Python's `-m freetoken_engine.cli`)",
    "FREETOKEN_AGENT_SIMULATED_GPU": "JSON file of a simulated GPU (tests, machines without one)",
    "FREETOKEN_AGENT_HEADROOM_BYTES": "free memory the policy keeps for the node's owner (1 GiB)",
    "FREETOKEN_AGENT_HEADROOM_FRACTION": "headroom as a share of total memory, if larger (0.05)",
    "FREETOKEN_AGENT_HYSTERESIS_BYTES": "extra free memory needed before growing (512 MiB)",
    "FREETOKEN_AGENT_COOLDOWN_SECONDS": "no growth for this long after a shrink (30)",
    "FREETOKEN_AGENT_GROW_INTERVAL_SECONDS": "seconds between grow steps (5)",
    "FREETOKEN_AGENT_GROW_STEP_FRACTION": "largest grow step, share of a cache's maximum (0.25)",
    "FREETOKEN_AGENT_TICK_SECONDS": "how often memory is read and the policy applied (0.2)",
    "FREETOKEN_AGENT_CALIBRATE_INTERVAL_SECONDS": "re-measure calibration this often (86400; 0: never)",
    "FREETOKEN_AGENT_CALIBRATE_ON_START": "1: measure at start when nothing is cached (default); 0: never",
    "FREETOKEN_AGENT_BACKOFF_MAX_SECONDS": "longest wait between engine restarts (60)",
    "FREETOKEN_AGENT_HEALTH_INTERVAL_SECONDS": "engine health-check period (1)",
    "FREETOKEN_AGENT_KEY_RECHECK_SECONDS": "how often running engines' API-key Secrets are read again (30)",
    "FREETOKEN_AGENT_ADMIN_TOKEN": "the engines' /admin token (default: a random one per engine)",
    "FREETOKEN_AGENT_MODEL_STORE_KEEP_DAYS": "a download no assignment names is deleted after this many "
                                             "days unused (7; 0: at the next pass, within 10 minutes)",
}


class ConfigError(ValueError):
    """A command-line option or environment variable has an invalid value."""


def _num(env: dict, name: str, default: float, kind=float):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def default_engine_command() -> tuple[str, ...]:
    return (sys.executable, "-m", "freetoken_engine.cli")


def default_state_dir() -> str:
    if os.geteuid() == 0:
        return "/var/lib/freetoken-agent"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "freetoken-agent")


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    kube_server: str | None = None
    standalone: str | None = None
    address: str = "127.0.0.1"
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9400
    engine_port_offset: int = 0
    state_dir: str = field(default_factory=default_state_dir)
    model_store: str | None = None        # source.url downloads (None: STATE_DIR/models)
    heartbeat_seconds: float = 5.0
    engine_command: tuple[str, ...] = field(default_factory=default_engine_command)
    simulated_gpu: str | None = None
    policy: PolicyConfig = PolicyConfig()
    tick_seconds: float = 0.2
    calibrate_interval: float = 86400.0
    calibrate_on_start: bool = True
    backoff_max: float = 60.0
    health_interval: float = 1.0
    admin_token: str | None = None
    key_recheck_seconds: float = 30.0     # how often running replicas' API-key Secrets are read again
    model_store_keep_days: float = 7.0    # unassigned downloads are deleted after this long unused

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ConfigError("--node-name (or NODE_NAME) is required")
        if self.standalone is None and self.kube_server is None and not _in_cluster_or_kubeconfig():
            raise ConfigError("no Kubernetes to talk to: give --standalone FILE or --kube-server URL, "
                              "or run in a cluster / with a kubeconfig")
        if self.kube_server is not None and not self.kube_server.startswith(("http://", "https://")):
            raise ConfigError(f"--kube-server must be an http(s):// URL, got {self.kube_server!r}")
        if self.standalone is None and not _object_name(self.node_name):
            raise ConfigError(f"--node-name {self.node_name!r} cannot name a FreeTokenNode: lowercase letters, "
                              "digits, '-' and '.', at most 253 (the Kubernetes Node's name)")
        if not _host(self.address):
            raise ConfigError(f"--address {self.address!r} is neither an IP address nor a host name")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port {self.metrics_port} is not a port")
        if self.heartbeat_seconds <= 0 or self.tick_seconds <= 0:
            raise ConfigError("--heartbeat-seconds and the tick must be > 0")
        if self.model_store_keep_days < 0:
            raise ConfigError("FREETOKEN_AGENT_MODEL_STORE_KEEP_DAYS must be >= 0")
        if self.key_recheck_seconds <= 0:
            raise ConfigError("FREETOKEN_AGENT_KEY_RECHECK_SECONDS must be > 0")
        if self.calibrate_interval < 0 or self.backoff_max <= 0 or self.health_interval <= 0:
            raise ConfigError("calibrate interval must be >= 0, backoff and health interval > 0")

    @property
    def bind_host(self) -> str:
        """Engines listen where the node's address is (loopback stays loopback)."""
        return self.address

    @property
    def store(self) -> str:
        return self.model_store or os.path.join(self.state_dir, "models")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.state_dir, "logs")


_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


def _object_name(name: str) -> bool:
    """An RFC 1123 subdomain, as Kubernetes object names (and so Node names) are."""
    return len(name) <= 253 and re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", name) is not None


def _host(address: str) -> bool:
    """An IP address, or a host name that does not look like a broken IPv4 address."""
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        pass
    labels = address.lower().split(".")
    return (not all(label.isdigit() for label in labels)
            and all(re.fullmatch(_LABEL, label) and len(label) <= 63 for label in labels))


def _in_cluster_or_kubeconfig() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or os.path.exists(
        os.environ.get("KUBECONFIG", os.path.expanduser("~/.kube/config")).split(os.pathsep)[0])


def policy_from_env(env: dict) -> PolicyConfig:
    d = PolicyConfig()
    try:
        return PolicyConfig(
            headroom_bytes=_num(env, "FREETOKEN_AGENT_HEADROOM_BYTES", d.headroom_bytes, int),
            headroom_fraction=_num(env, "FREETOKEN_AGENT_HEADROOM_FRACTION", d.headroom_fraction),
            hysteresis_bytes=_num(env, "FREETOKEN_AGENT_HYSTERESIS_BYTES", d.hysteresis_bytes, int),
            cooldown_seconds=_num(env, "FREETOKEN_AGENT_COOLDOWN_SECONDS", d.cooldown_seconds),
            grow_interval_seconds=_num(env, "FREETOKEN_AGENT_GROW_INTERVAL_SECONDS", d.grow_interval_seconds),
            grow_step_fraction=_num(env, "FREETOKEN_AGENT_GROW_STEP_FRACTION", d.grow_step_fraction),
        )
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from exc


def from_env(env: dict | None = None, **cli) -> AgentConfig:
    """Build the config from command-line values (``None`` = not given) and the environment."""
    env = dict(os.environ if env is None else env)
    given = {k: v for k, v in cli.items() if v is not None}
    given.setdefault("node_name", env.get("NODE_NAME", ""))
    if "address" not in given and env.get("NODE_IP"):
        given["address"] = env["NODE_IP"]
    if env.get("FREETOKEN_AGENT_ENGINE_COMMAND"):
        given["engine_command"] = tuple(shlex.split(env["FREETOKEN_AGENT_ENGINE_COMMAND"]))
    if env.get("FREETOKEN_AGENT_ADMIN_TOKEN"):
        given["admin_token"] = env["FREETOKEN_AGENT_ADMIN_TOKEN"]
    if env.get("FREETOKEN_AGENT_SIMULATED_GPU"):
        given["simulated_gpu"] = env["FREETOKEN_AGENT_SIMULATED_GPU"]
    return AgentConfig(
        policy=policy_from_env(env),
        tick_seconds=_num(env, "FREETOKEN_AGENT_TICK_SECONDS", 0.2),
        calibrate_interval=_num(env, "FREETOKEN_AGENT_CALIBRATE_INTERVAL_SECONDS", 86400.0),
        calibrate_on_start=env.get("FREETOKEN_AGENT_CALIBRATE_ON_START", "1") not in ("0", "false", "no"),
        backoff_max=_num(env, "FREETOKEN_AGENT_BACKOFF_MAX_SECONDS", 60.0),
        health_interval=_num(env, "FREETOKEN_AGENT_HEALTH_INTERVAL_SECONDS", 1.0),
        key_recheck_seconds=_num(env, "FREETOKEN_AGENT_KEY_RECHECK_SECONDS", 30.0),
        model_store_keep_days=_num(env, "FREETOKEN_AGENT_MODEL_STORE_KEEP_DAYS", 7.0),
        **given)
