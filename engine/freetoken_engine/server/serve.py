"""``freetoken serve``: start the EngineService, build the app, run uvicorn until interrupted.

``serve_main(args)`` takes the argparse namespace of the lead's CLI (``--host``, ``--port``,
``--api-key``, ``--admin-token``, ``--served-model-name`` plus the engine's model, device and
cache options, which ``EngineConfig`` reads). The HTTP server listens at once; ``/health``
answers 503 ``loading`` with progress until the model is ready. Returns the exit code.
"""
from __future__ import annotations

import logging

from ..errors import ConfigError
from .app import ServerConfig, create_app

log = logging.getLogger(__name__)


def server_config(args) -> ServerConfig:
    return ServerConfig(api_key=getattr(args, "api_key", None) or None,
                        admin_token=getattr(args, "admin_token", None) or None,
                        served_model_name=getattr(args, "served_model_name", None) or None)


def serve_main(args) -> int:
    import uvicorn

    from ..scheduler.service import EngineConfig, EngineService

    host, port = getattr(args, "host", "127.0.0.1"), int(getattr(args, "port", 1919))
    if not 0 < port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    config = server_config(args)
    service = EngineService.start(EngineConfig.from_args(args))
    try:
        app = create_app(service, config)
        if not config.admin_token and host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("no --admin-token: /admin/* accepts loopback clients only")
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        service.shutdown()
    return 0
