"""Fixtures for the API tests: the tiny checkpoint, its EngineService, a live server per module."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from live import API_KEY, live_server, start_service  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_service(tiny_dir):
    svc = start_service(tiny_dir, max_context=512)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="module")
def live(tiny_service):
    with live_server(tiny_service, api_key=API_KEY) as srv:
        yield srv
