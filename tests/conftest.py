"""Shared fixtures. ``tiny_models.make_tiny_checkpoint`` writes transformers checkpoints;
``tiny_checkpoint(model_type, **overrides)`` caches them for the whole test session."""
from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import make_tiny_checkpoint  # noqa: E402

# Keep test runs away from the user's caches (converted default model, calibration) unless a
# session-wide cache folder is given, and keep torch from oversubscribing the 2-core CI machine.
os.environ.setdefault("FREETOKEN_CACHE_DIR", str(Path(__file__).parent.parent / ".test-cache"))
# Tiny test models gain nothing from intra-op threads, and spinning OpenMP workers make every
# op slow when the machine is shared; subprocesses (CLI, servers) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402


torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Property tests (hypothesis) run the same examples on every run, so that a green suite stays
# green and a red one is reproducible; FREETOKEN_FUZZ=explore draws new ones (find bugs
# locally, then keep each failing case as an @example).
from hypothesis import settings  # noqa: E402

settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("FREETOKEN_FUZZ") == "explore" else "fixed")


def pytest_configure(config):
    """Triton's interpreter is chosen per process, when a kernel module is imported: it runs the
    kernels on CPU tensors in every run but one that selects the GPU tests on a machine with a
    GPU (``pytest -m gpu``), where the kernels compile and the interpreter tests are deselected.
    Decided here, before collection imports any kernel; TRITON_INTERPRET set by hand wins."""
    expr = config.option.markexpr or ""
    gpu_run = torch.cuda.is_available() and "gpu" in expr and "not gpu" not in expr
    if not gpu_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import interpreter_once
        interpreter_once.install()


# Two worker processes (pytest-xdist, ``-n 2``) run the suite on a 2-CPU machine. A test that
# measures the CPUs themselves (a busy process beside the kernel's workers, a calibration that
# must see them quiet) would measure the other worker too: it is marked ``quiet_cpu`` and runs
# while every other worker waits between its tests. Two file locks shared by the workers: each
# test holds "run" shared (a quiet one exclusive); "gate" is taken before "run", and a quiet test
# keeps it until it ends, so the other worker cannot start a test meanwhile (no starvation).
_LOCKS: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid:
        yield
        return
    if not _LOCKS:
        base = Path(tempfile.gettempdir()) / f"freetoken-tests-{uid}"
        _LOCKS.extend(open(f"{base}.{name}", "a+") for name in ("gate", "run"))
    gate, run = _LOCKS
    quiet = item.get_closest_marker("quiet_cpu") is not None
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(run, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
    if not quiet:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
        if quiet:
            fcntl.flock(gate, fcntl.LOCK_UN)


def pytest_sessionfinish(session):
    for f in _LOCKS:                     # a worker's own descriptors keep the lock files usable
        Path(f.name).unlink(missing_ok=True)


#: a folder of tiny checkpoints (``<model_type>/``, the defaults' only) written where transformers
#: has the family, for a machine whose transformers does not (``python tests/tiny_models.py DIR TYPE...``)
PREBUILT = "FREETOKEN_TINY_CHECKPOINTS"


def _prebuilt(model_type: str, overrides: dict) -> Path | None:
    folder = Path(os.environ.get(PREBUILT, "/nonexistent")) / model_type
    return folder if not overrides and (folder / "config.json").is_file() else None


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    made: dict = {}

    def get(model_type: str = "qwen3_moe", **overrides) -> Path:
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = _prebuilt(model_type, overrides) or _make(model_type, overrides)
        return made[key]

    def _make(model_type: str, overrides: dict) -> Path:
        from tiny_configs import classes
        try:
            classes(model_type)
        except AttributeError as exc:
            if not torch.cuda.is_available():
                raise                      # CI's transformers must have every family: fail loudly
            # the GPU machine's older transformers lacks the family
            pytest.skip(f"this transformers cannot write a {model_type} checkpoint ({exc}); "
                        f"set {PREBUILT} to a folder of checkpoints written where it can")
        return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{model_type}"), model_type, **overrides)

    return get


@pytest.fixture(scope="session")
def tiny_packed(tiny_checkpoint, tmp_path_factory):
    """(source folder, packed folder) of the tiny qwen3_moe checkpoint. Small shards: the bank
    splits into one piece per MoE layer, the dense tensors into several files. Tests that damage
    files work on a ``copy_folder`` of it."""
    from freetoken_engine.packed import convert
    src = tiny_checkpoint("qwen3_moe")
    out = tmp_path_factory.mktemp("packed") / "tiny-packed"
    convert(src, out, shard_bytes=40_000, progress=False)
    return src, out
