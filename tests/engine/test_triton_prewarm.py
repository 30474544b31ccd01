"""Triton's per-process cache key computed beside the engine's build (``kernels/triton/prewarm.py``)."""
from __future__ import annotations

import json
import subprocess
import sys

from freetoken_engine.kernels.triton import prewarm

PROBE = """
import json
from freetoken_engine.kernels.triton import prewarm
thread, done = prewarm.start()
thread.join()
from triton.runtime.cache import triton_key
print(json.dumps({"seconds": done.get("seconds"), "cached": triton_key.cache_info().currsize}))
"""


def test_the_key_the_first_launch_needs_is_made_ahead_in_a_new_process():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["seconds"] > 0 and got["cached"] == 1        # the launch then finds it cached


def test_a_triton_without_the_function_is_left_alone(monkeypatch):
    monkeypatch.setattr(prewarm, "_HOMES", ("freetoken_engine.no_such_module", "json"))
    thread, done = prewarm.start()
    thread.join(10)
    assert not thread.is_alive() and done == {}
