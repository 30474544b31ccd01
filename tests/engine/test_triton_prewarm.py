"""Triton's per-process cache key made beside the engine's build, and kept between processes
(``kernels/triton/prewarm.py``)."""
from __future__ import annotations

import os

from procs import python_json

from freetoken_engine.kernels.triton import prewarm

PROBE = """
import json, sys
import triton.runtime.cache as cache
original = cache.triton_key
from freetoken_engine.kernels.triton import prewarm
thread, done = prewarm.start(cache=__import__("pathlib").Path(sys.argv[1]), backend=False)
thread.join()
installed = cache.triton_key()                      # what the first launch's get_cache_key calls
computed_here = original.cache_info().currsize      # 1 when this process hashed Triton's files
print(json.dumps({"stored": done.get("stored"), "computed_here": computed_here,
                  "installed": installed, "true_key": original()}))
"""


def _probe(cache_dir) -> dict:
    return python_json(PROBE, str(cache_dir), timeout=120)


def test_a_restart_installs_the_stored_key_without_hashing_triton_and_it_is_the_true_key(tmp_path):
    first = _probe(tmp_path)
    assert first["stored"] is False and first["computed_here"] == 1      # computed, then kept
    assert first["installed"] == first["true_key"]
    again = _probe(tmp_path)
    assert again["stored"] is True and again["computed_here"] == 0       # read: no 500 MB hash
    assert again["installed"] == again["true_key"]                       # and still the right key


def _tree(tmp_path):
    root = tmp_path / "triton"
    for sub in ("compiler", "backends/nvidia", "language", "runtime"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "backends/nvidia/include").mkdir()
    (root / "backends/nvidia/include/cuda.h").write_text("// not hashed by triton_key")
    (root / "compiler/compiler.py").write_text("x = 1\n")
    (root / "_C").mkdir()
    (root / "_C/libtriton.so").write_bytes(b"\0" * 64)
    return root


def test_the_stored_key_is_computed_again_when_a_file_triton_hashes_changes(tmp_path):
    root, cache, calls = _tree(tmp_path), tmp_path / "cache", []

    def compute():
        calls.append(1)
        return f"key{len(calls)}"
    assert prewarm.stored_key(root, compute, cache) == ("key1", False)
    assert prewarm.stored_key(root, compute, cache) == ("key1", True)
    (root / "backends/nvidia/include/cuda.h").write_text("// edited: not part of the key")
    assert prewarm.stored_key(root, compute, cache) == ("key1", True)
    os.utime(root / "compiler/compiler.py", ns=(1, 1))                  # the compiler changed
    assert prewarm.stored_key(root, compute, cache) == ("key2", False)
    (root / "_C/libtriton.so").write_bytes(b"\1" * 65)                   # a new libtriton
    assert prewarm.stored_key(root, compute, cache) == ("key3", False)
    assert len(calls) == 3


def test_a_corrupt_or_unwritable_cache_only_costs_the_computation(tmp_path):
    root, cache = _tree(tmp_path), tmp_path / "cache"
    prewarm.stored_key(root, lambda: "good", cache)
    for f in cache.iterdir():
        f.write_text("{not json")
    assert prewarm.stored_key(root, lambda: "again", cache) == ("again", False)
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    assert prewarm.stored_key(root, lambda: "k", blocked / "cache") == ("k", False)


def test_a_triton_without_the_function_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(prewarm, "_HOMES", ("freetoken_engine.no_such_module", "json"))
    thread, done = prewarm.start(cache=tmp_path, backend=False)
    thread.join(10)
    assert not thread.is_alive() and done == {} and not list(tmp_path.iterdir())
