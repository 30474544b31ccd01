"""``freetoken-agent``: the node agent's command line (docs/contracts.md).

    freetoken-agent calibrate [--json] [--refresh]
    freetoken-agent run --node-name NAME [--kube-server URL] [--standalone FILE] ...

Bad input: one line on stderr, exit code 2 (like the engine's CLI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import socket
import sys

from . import config as config_mod
from .assignments import StandaloneFile
from .calibration import CalibrationCache, CalibrationError, HostConfig
from .gpu import GpuError, NvmlSource


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="freetoken-agent", description="FreeToken node agent")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="measure (or show the cached) PCIe / CPU-expert bandwidth and q*")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--refresh", action="store_true", help="measure even when a cached result exists")
    c.add_argument("--state-dir", default=None, help="where results are cached")
    r = sub.add_parser("run", help="run engines for this node's assignments and watch memory pressure")
    r.add_argument("--node-name", default=None, help="this node's name (default: $NODE_NAME)")
    r.add_argument("--kube-server", default=None, help="plain-HTTP API server URL (tests)")
    r.add_argument("--standalone", default=None, metavar="FILE", help="YAML file with `models:`")
    r.add_argument("--address", default=None, help="where engines are reachable (default $NODE_IP or 127.0.0.1)")
    r.add_argument("--metrics-host", default=None)
    r.add_argument("--metrics-port", type=int, default=None)
    r.add_argument("--engine-port-offset", type=int, default=None)
    r.add_argument("--state-dir", default=None)
    r.add_argument("--model-store", default=None, metavar="DIR",
                   help="where models of a source.url are downloaded and kept (default: STATE_DIR/models)")
    r.add_argument("--heartbeat-seconds", type=float, default=None)
    r.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
    return p


def _fail(msg: str) -> int:
    print(f"freetoken-agent: {msg}", file=sys.stderr)
    return 2


def calibrate(args: argparse.Namespace) -> int:
    node = os.environ.get("NODE_NAME") or socket.gethostname()
    try:
        nv = NvmlSource.open()
        gpus = tuple(g.name for g in nv.read())
        nv.close()
    except GpuError:
        gpus = ()
    host = HostConfig.detect(node, gpus)
    env_cmd = os.environ.get("FREETOKEN_AGENT_ENGINE_COMMAND")
    engine = tuple(shlex.split(env_cmd)) if env_cmd else config_mod.default_engine_command()
    cache = CalibrationCache(args.state_dir or config_mod.default_state_dir())
    try:
        result, fresh = asyncio.run(cache.load_or_measure(host, engine, refresh=args.refresh))
    except (CalibrationError, OSError) as exc:
        print(f"freetoken-agent: calibration failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    conc = result.get("concurrent") or {}
    fmt = lambda v: "n/a" if v is None else f"{v:.1f} GB/s"  # noqa: E731
    print(f"node {node}: {'measured now' if fresh else 'cached'} ({cache.path(host)})")
    print(f"  PCIe host->device      {fmt(result.get('pcie_gbps'))}  (concurrent {fmt(conc.get('pcie_gbps'))})")
    print(f"  CPU expert kernel      {fmt(result.get('cpu_expert_gbps'))}  (concurrent {fmt(conc.get('cpu_expert_gbps'))})")
    print(f"  q* fill fraction       {result['fill_fraction']:.3f}")
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):   # lines per health check and scrape: noise, even at DEBUG
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # the Kubernetes client's retries: the agent's own line says when the API server is away
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    try:
        cfg = config_mod.from_env(
            node_name=args.node_name, kube_server=args.kube_server, standalone=args.standalone,
            address=args.address, metrics_host=args.metrics_host, metrics_port=args.metrics_port,
            engine_port_offset=args.engine_port_offset, state_dir=args.state_dir,
            model_store=args.model_store, heartbeat_seconds=args.heartbeat_seconds)
    except config_mod.ConfigError as exc:
        return _fail(str(exc))
    if cfg.standalone and not os.path.exists(cfg.standalone):
        return _fail(f"--standalone {cfg.standalone}: no such file")
    if cfg.standalone:      # a broken file at start is an error; later edits are logged (agent.py)
        probe = StandaloneFile(cfg.standalone)
        probe.read()
        if probe.error:
            return _fail(f"--standalone {probe.error}")
    from .agent import Agent  # imported here: `calibrate` needs none of it

    agent = Agent(cfg)
    logging.getLogger(__name__).info(
        "agent on node %s: %s mode, memory domain %s, metrics on %s:%d", cfg.node_name,
        agent.controller.mode, agent.controller.domain, cfg.metrics_host, cfg.metrics_port)
    asyncio.run(agent.run())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return calibrate(args) if args.command == "calibrate" else run(args)


if __name__ == "__main__":
    sys.exit(main())
