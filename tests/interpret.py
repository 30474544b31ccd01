"""The guard shared by the tests that run Triton kernels on CPU tensors under TRITON_INTERPRET=1.
The interpreter is on unless told otherwise, or unless the run selects the GPU tests on a GPU
(``conftest.pytest_configure``, which runs before any test module imports Triton)."""
from __future__ import annotations

import functools
import os

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


@triton.jit
def _probe_kernel(out_ptr, n):
    acc = 0
    for i in range(tl.program_id(0), n, 1):
        acc += i
    tl.store(out_ptr, acc)


@functools.cache
def _interpreter_takes_scalar_bounds() -> bool:
    """Triton 3.6's interpreter cannot use a scalar argument or a program id as a loop bound
    (3.9's can); every kernel of the engine does."""
    out = torch.zeros(1, dtype=torch.int64)
    try:
        _probe_kernel[(1,)](out, 4)
    except Exception:   # noqa: BLE001  (InterpreterError, TypeError: whatever that version raises)
        return False
    return int(out[0]) == 6


def require() -> None:
    """Skip the calling module unless its kernels can run: under an interpreter that can run
    them (CPU tensors), or compiled on a GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        if not torch.cuda.is_available():
            pytest.skip("Triton needs TRITON_INTERPRET=1 without a GPU", allow_module_level=True)
        return
    if not _interpreter_takes_scalar_bounds():
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot take a scalar as a loop bound "
                    "(3.9's can: pip install -U triton)", allow_module_level=True)
