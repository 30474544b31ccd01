"""Live servers on loopback for the API tests: uvicorn in a thread, one per test module.

``live_server(service, **config)`` starts the real FastAPI app around an EngineService on an
ephemeral port and yields a ``Live`` with the base URL and ready-made official clients.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import uvicorn

from freetoken_engine.server.app import ServerConfig, create_app

API_KEY = "test-key"


@dataclass
class Live:
    url: str
    app: object
    service: object

    @property
    def model(self) -> str:
        return self.app.state.config.served_model_name or self.service.model_name

    def openai(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", API_KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def anthropic(self, **kw) -> anthropic.Anthropic:
        kw.setdefault("api_key", API_KEY)
        return anthropic.Anthropic(base_url=self.url, max_retries=0, timeout=60, **kw)


class _Server:
    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> int:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def live_server(service, **config):
    """Context manager: a started server around ``service``; yields ``Live``."""
    from contextlib import contextmanager

    @contextmanager
    def _cm():
        app = create_app(service, ServerConfig(**config))
        with _Server(app) as port:
            yield Live(f"http://127.0.0.1:{port}", app, service)
    return _cm()



def wait_ready(service, timeout=120.0):
    deadline = time.monotonic() + timeout
    while service.health()["status"] == "loading":
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not load")
        time.sleep(0.05)
    h = service.health()
    if h["status"] != "ok":
        raise RuntimeError(f"engine failed: {h}")
    return service


def start_service(model_dir: Path, **options):
    """A real EngineService on ``model_dir``, loaded (``options`` go to EngineConfig)."""
    from freetoken_engine.config import EngineConfig
    from freetoken_engine.scheduler.service import EngineService
    return wait_ready(EngineService.start(EngineConfig(model=model_dir, **options)))


def serving(model_dir: Path, **options):
    """Context manager: a real EngineService on ``model_dir`` (``options`` go to EngineConfig)
    behind a server with ``API_KEY``; yields the ``Live``, shuts the service down after."""
    from contextlib import contextmanager

    @contextmanager
    def _cm():
        svc = start_service(model_dir, **options)
        try:
            with live_server(svc, api_key=API_KEY) as srv:
                yield srv
        finally:
            svc.shutdown()
    return _cm()


def live_pair(model_dir: Path, first: dict, second: dict):
    """Context manager: two services on ``model_dir`` (EngineConfig ``first`` and ``second``),
    each behind its own server with ``API_KEY``; yields the two ``Live``s."""
    from contextlib import contextmanager

    @contextmanager
    def _cm():
        a, b = start_service(model_dir, **first), start_service(model_dir, **second)
        try:
            with live_server(a, api_key=API_KEY) as la, live_server(b, api_key=API_KEY) as lb:
                yield la, lb
        finally:
            a.shutdown()
            b.shutdown()
    return _cm()


@pytest.fixture(scope="module", name="live")
def served_folder(folder):
    """``live`` for a tool-format test module: its ``folder`` (a random model in that format)
    behind a started server with 1,024 tokens of context."""
    with serving(folder, max_context=1024) as srv:
        yield srv
