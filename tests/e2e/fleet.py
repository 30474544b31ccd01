"""Helpers for end-to-end tests: free ports, real agent processes, a real Prometheus server.

Everything here starts real programs (``freetoken-agent run``, which starts ``freetoken serve``;
the ``prometheus`` binary from the Debian package) on loopback and stops them by pid.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from procs import engine_pids  # noqa: F401  (re-exported: fleet.engine_pids)

GB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(name: str) -> str:
    """A console script of this environment (``pip install -e .`` puts them next to python)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise FileNotFoundError(f"{path}: install the project (pip install -e .)")
    return str(path)


def agent_env(**extra: str) -> dict[str, str]:
    """Fast agent timings for tests, one torch thread per engine (2-core CI machine)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "FREETOKEN_AGENT_TICK_SECONDS": "0.2",
            "FREETOKEN_AGENT_HEALTH_INTERVAL_SECONDS": "0.3", "FREETOKEN_AGENT_BACKOFF_MAX_SECONDS": "1",
            "FREETOKEN_AGENT_CALIBRATE_ON_START": "0", **extra}


def start_agent(tmp: Path, node: str, *, metrics_port: int, port_offset: int, kube_server: str | None = None,
                standalone: Path | None = None, heartbeat: float = 1.0, env: dict[str, str] | None = None
                ) -> subprocess.Popen:
    cmd = [script("freetoken-agent"), "run", "--node-name", node, "--address", "127.0.0.1",
           "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
           "--engine-port-offset", str(port_offset), "--state-dir", str(tmp / f"state-{node}"),
           "--heartbeat-seconds", str(heartbeat)]
    if kube_server:
        cmd += ["--kube-server", kube_server]
    if standalone:
        cmd += ["--standalone", str(standalone)]
    log = open(tmp / f"agent-{node}.log", "wb")
    # own process group: stopping the agent and anything it left behind is one killpg by pid
    return subprocess.Popen(cmd, env=env or agent_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Stop ``proc`` (and its process group); SIGKILL after ``timeout``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


async def astop(procs: list[subprocess.Popen], timeout: float = 20) -> None:
    """``stop`` for code running on an event loop that the stopping processes still talk to
    (kmock): signal all, then await their exit without blocking the loop."""
    import asyncio

    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    for proc in procs:
        stop(proc, sig=signal.SIGKILL, timeout=5)




def wait_until(check: Callable[[], Any], timeout: float, what: str, step: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (httpx.HTTPError, OSError, KeyError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


class Prometheus:
    """The real Prometheus server on loopback, scraping ``targets`` every second."""

    def __init__(self, tmp: Path, targets: list[str], rule_files: list[Path] = ()) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(json.dumps({   # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "freetoken-agent", "static_configs": [{"targets": targets}]}]}))
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "wb"), start_new_session=True)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises AssertionError with Prometheus' message on a bad expression."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule with its evaluation ``health`` ("ok", "err", "unknown")."""
        body = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def close(self) -> None:
        stop(self.proc, timeout=10)
