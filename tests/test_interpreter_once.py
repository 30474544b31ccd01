"""The test harness's shortcut in Triton's interpreter (interpreter_once.py): a kernel's helpers
no longer patch triton.language again, the kernel's result is unchanged, and the language is
restored after the launch as before."""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter runs only without a GPU run", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import interpreter_once  # noqa: E402


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _twice_scaled_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, _scaled(_scaled(x, 2.0), 3.0), mask=i < n)


def test_helpers_inside_a_launch_skip_the_second_patch_and_change_nothing():
    from triton.runtime import interpreter as ti
    assert getattr(ti, "_ft_once", False), "conftest did not install the shortcut"
    x = torch.randn(40)
    out = torch.empty_like(x)
    before = dict(interpreter_once.COUNTS)
    _twice_scaled_kernel[(3,)](x, out, x.numel(), BLOCK=16)
    assert torch.equal(out, x * 2.0 * 3.0)
    assert interpreter_once.COUNTS["patched"] - before["patched"] == 1          # the launch's own
    assert interpreter_once.COUNTS["skipped"] - before["skipped"] == 2 * 3     # two helpers a program
    assert all(tl.core.is_builtin(f) for f in (tl.load, tl.store, tl.arange))   # restored afterwards
