"""``freetoken-operator``: run the kopf operator cluster-wide with the FreeToken handlers.

    freetoken-operator [--kube-server URL] [--stale-seconds 30] [--resync-seconds 1]
                       [--base-port 1919] [--api-timeout-seconds 30] [--liveness http://0.0.0.0:8080/healthz] [--verbose]

Flags override the environment variables documented in ``config``. Bad values: one line on
stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
import urllib.parse

from .config import ConfigError, OperatorConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")


def _liveness(url: str) -> str:
    """kopf's liveness endpoint: it serves plain HTTP only (else it fails at start with a
    traceback), on the host and port given (localhost and 80 when left out)."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port
    except ValueError:
        parts = parts._replace(scheme="")
    if parts.scheme != "http":
        raise argparse.ArgumentTypeError(f"must be http://HOST:PORT/PATH, e.g. http://0.0.0.0:8080/healthz, got {url!r}")
    return url


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="freetoken-operator", description=__doc__.split("\n")[0])
    p.add_argument("--kube-server", help="plain-HTTP API server URL (tests); default: in-cluster, then kubeconfig")
    p.add_argument("--stale-seconds", type=float, help="heartbeat age after which a node is lost (default 30)")
    p.add_argument("--resync-seconds", type=float, help="reconcile tick (default 1)")
    p.add_argument("--base-port", type=int, help="first engine port per node (default 1919)")
    p.add_argument("--api-timeout-seconds", type=float, help="longest one API write may take (default 30)")
    p.add_argument("--liveness", default=None, type=_liveness,
                   help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--verbose", action="store_true")
    return p


def _no_connection_tracebacks(record: logging.LogRecord) -> bool:
    """kopf logs an API server it cannot reach with a traceback; its message already says it."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and record.name.startswith("kopf") and isinstance(exc, OSError | _client_error()):
        record.exc_info, record.exc_text = None, None
    return True


def _client_error() -> type:
    import aiohttp
    return aiohttp.ClientError


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = OperatorConfig.from_env(stale_seconds=args.stale_seconds, kube_server=args.kube_server,
                                         resync_seconds=args.resync_seconds, base_port=args.base_port,
                                         api_timeout_seconds=args.api_timeout_seconds)
    except ConfigError as exc:
        print(f"freetoken-operator: {exc}", file=sys.stderr)
        return 2
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers in kopf's default registry

    kopf.configure(verbose=args.verbose)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_no_connection_tracebacks)
    if not args.verbose:   # one "handler succeeded" line per heartbeat is noise; keep warnings
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    import aiohttp
    try:
        kopf.run(clusterwide=True, standalone=True, liveness_endpoint=args.liveness,
                 memo=kopf.Memo(config=config))
    except (aiohttp.ClientError, OSError) as exc:   # kopf gave up on the API server (5 attempts)
        where = config.kube_server or "the in-cluster / kubeconfig API server"
        print(f"freetoken-operator: cannot reach the Kubernetes API at {where}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
