"""Session fixture for tests that need the embedded default model (import it by name).

`default_moe_dir`: the default MoE folder, converted once per run into the engine cache
(tests/conftest.py points $FREETOKEN_CACHE_DIR at a test cache; `freetoken` subprocesses inherit
it and load the folder directly).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_moe_dir():
    from freetoken_engine.models.default import default_model_dir

    return default_model_dir(progress=False)
