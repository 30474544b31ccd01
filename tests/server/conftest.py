"""Fixtures for the API tests: the tiny checkpoint, its EngineService, a live server per module."""
from __future__ import annotations

from pathlib import Path

import pytest

from live import API_KEY, live_server, start_service


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint) -> Path:
    """The session's tiny random qwen3_moe checkpoint (tests/conftest.py)."""
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_service(tiny_dir):
    svc = start_service(tiny_dir, max_context=512)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def live(tiny_service):
    with live_server(tiny_service, api_key=API_KEY) as srv:
        yield srv
