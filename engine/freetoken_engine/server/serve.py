"""``freetoken serve``: start the EngineService, build the app, run uvicorn until interrupted.

``serve_main(args)`` takes the argparse namespace of the CLI: ``--host``, ``--port``,
``--api-key``, ``--admin-token``, ``--served-model-name`` for the HTTP side, and the engine
options of ``generate`` (``--model``, ``--device``, ``--dtype``, ``--expert-cache-experts`` /
``--expert-cache-gb``, ``--cpu-expert-fraction``, and ``--max-context`` / ``--max-batch`` /
``--max-queue`` where the CLI has them), read by ``engine_config``. The HTTP server listens as
soon as the service starts loading; ``/health`` answers 503 ``loading`` until it is ready.
Returns the process exit code; bad options raise ``ConfigError`` (the CLI prints it, exit 2).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import socket
from pathlib import Path

from ..config import EngineConfig
from ..errors import ConfigError
from .app import ServerConfig, create_app
from .auth import is_loopback

log = logging.getLogger(__name__)

# argparse attribute -> EngineConfig field, for the options the CLI may define
_ENGINE_OPTIONS = {"device": "device", "dtype": "dtype",
                   "expert_cache_experts": "expert_cache_experts",
                   "expert_cache_gb": "expert_cache_gb",
                   "cpu_expert_fraction": "cpu_expert_fraction", "max_context": "max_context",
                   "context_length": "max_context", "max_batch": "max_batch",
                   "max_queue": "max_queue", "seed": "seed", "expert_backend": "expert_backend",
                   "expert_format": "expert_format",
                   "cuda_graphs": "cuda_graphs", "graph_warmup": "graph_warmup",
                   "graph_warmup_widths": "graph_warmup_widths", "graph_memory_gb": "graph_memory_gb",
                   "split_tuning": "split_tuning", "prefill_chunk": "prefill_chunk",
                   "decode_pause_ms": "decode_pause_ms", "state_checkpoints": "state_checkpoints",
                   "cpu_rate_probe": "cpu_rate_probe", "fused_cpu_decode": "fused_cpu_decode",
                   "speculative_tokens": "speculative_tokens",
                   "speculative_ngram": "speculative_ngram", "speculative_max_batch": "speculative_max_batch",
                   "speculative_method": "speculative_method",
                   "speculative_draft_vocab": "speculative_draft_vocab"}


def server_config(args) -> ServerConfig:
    """The server's settings from the command line. An empty ``--api-key``, ``--admin-token`` or
    ``--served-model-name`` (``--api-key "$KEY"`` with KEY unset) is refused: it would serve
    without one (or under the default name), silently."""
    for flag, value in (("--api-key", getattr(args, "api_key", None)),
                        ("--admin-token", getattr(args, "admin_token", None)),
                        ("--served-model-name", getattr(args, "served_model_name", None))):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty (an unset variable?): give it a value, or leave {flag} out")
    return ServerConfig(api_key=getattr(args, "api_key", None) or None,
                        admin_token=getattr(args, "admin_token", None) or None,
                        served_model_name=getattr(args, "served_model_name", None) or None)


def engine_config(args) -> EngineConfig:
    model = getattr(args, "model", None)
    if model is None:
        from ..models.default import default_model_dir
        model = default_model_dir(progress=True)
    options = {field: getattr(args, attr) for attr, field in _ENGINE_OPTIONS.items()
               if getattr(args, attr, None) is not None}
    return EngineConfig(model=Path(model), **options)


def serve_main(args) -> int:
    import uvicorn

    from ..scheduler.service import EngineService

    host = getattr(args, "host", None) or "127.0.0.1"
    port = 1919 if getattr(args, "port", None) is None else args.port     # --port 0 is refused, not 1919
    if not 0 < int(port) < 65536:
        raise ConfigError(f"--port must be within 1..65535, got {port}")
    config = server_config(args)
    sock = listening_socket(host, int(port))      # before the model loads: a busy port fails at once
    try:
        service = EngineService.start(engine_config(args))
        try:
            app = create_app(service, config)
            if not config.admin_token:
                log.info("no --admin-token: /admin/* accepts loopback clients only")
            if not config.api_key and not is_loopback(host):
                log.warning("serving on %s without --api-key: anyone who can reach it can use the model", host)
            server = _Server(uvicorn.Config(app, host=host, port=int(port), log_level="info",
                                            timeout_graceful_shutdown=5))
            shown = f"[{host}]" if ":" in host else host     # uvicorn says this only for sockets it binds
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                    shown, int(port))
            server.run(sockets=[sock])
        finally:
            service.shutdown()
    finally:
        sock.close()
    return 0


def _Server(config):
    """uvicorn's server, except that the signal which stopped it (Ctrl-C, SIGTERM from the agent
    or Kubernetes) is not raised again once it has: the engine then shuts down in order and the
    process exits 0 (a re-raised SIGTERM killed it before the engine's shutdown, exit 143)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    getattr(self, "_captured_signals", []).clear()

    return Server(config)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn serves on it); ConfigError in one line when
    the address cannot be had (a busy port, an address not on this machine)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # "::" takes IPv4 too
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        hint = " (another server on that port? pick another --port)" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock

