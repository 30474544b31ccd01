"""The GPU decode's MoE combine (kernels/triton/combine.py) and the residual add fused into the
norm (kernels/triton/norm.py ``add_rms_norm``) against their references, on CPU under
TRITON_INTERPRET=1 (CI) and compiled on a GPU (``TRITON_INTERPRET=0 pytest`` this file there).
Tolerance: fp32 1e-6 of the largest output; 16-bit 2^-7 (2^-6 under the interpreter, which
truncates fp32 -> 16-bit instead of rounding); the add + norm is bitwise the two separate ops."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.kernels.reference import (SplitRows, add_rms_norm_forward, moe_combine_forward,  # noqa: E402
                                                rms_norm_forward)
from freetoken_engine.kernels.triton import combine as tc  # noqa: E402
from freetoken_engine.kernels.triton import norm as tn  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"
REL16 = 2.0 ** -7 if COMPILED else 2.0 ** -6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    top = want.float().abs().max()
    tol = 1e-6 * top + 1e-7 if want.dtype == torch.float32 else REL16 * top
    assert (got.float() - want.float()).abs().max() <= tol


def _problem(t: int, k: int, h: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, h, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    return g, rows, weights


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("t,k,h", [(1, 8, 2048), (4, 8, 96), (3, 2, 1500)])
@pytest.mark.parametrize("extras", ["plain", "shared", "residual", "both"])
def test_combine_matches_reference(t, k, h, dtype, extras):
    g, rows, weights = _problem(t, k, h, dtype, t * 100 + h)
    shared = torch.randn(t, h, generator=g).to(dtype) if extras in ("shared", "both") else None
    residual = (4 * torch.randn(t, h, generator=g)).to(dtype) if extras in ("residual", "both") else None
    want = moe_combine_forward(rows, weights, shared, residual)
    dev = [a.to(DEVICE) if a is not None else None for a in (rows, weights, shared, residual)]
    assert tc.supported(*dev)
    _close(tc.combine(*dev).cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("part", [False, True], ids=["whole", "streamed-part"])
def test_combine_selects_host_rows_in_pair_order(dtype, part):
    """The CPU branch's layout: host pairs (slot < 0) take the next compact host row (plus the
    streamed split's device part); device pairs their own row, whatever the host buffer holds
    after the used rows. A wrong rank, or a device row leaking into a host pair, fails."""
    t, k, h = 3, 4, 160
    g, gpu, weights = _problem(t, k, h, dtype, 7)
    slot = torch.tensor([3, -1, 0, -1, -1, 5, 2, 1, 4, -1, 6, 7])
    n_host = int((slot < 0).sum())
    host = torch.randn(n_host + 5, h, generator=g).to(dtype)     # rows past the used ones: garbage
    gpu[slot < 0] = 1e4                                          # never read for host pairs
    streamed = torch.where((slot < 0)[:, None], torch.randn(t * k, h, generator=g), 0).to(dtype) if part else None
    rows = SplitRows(gpu, slot, host, streamed)
    dense = rows.dense()
    assert torch.equal(dense[1], (host[0] + streamed[1]) if part else host[0])
    assert torch.equal(dense[9], (host[3] + streamed[9]) if part else host[3])
    residual = torch.randn(t, h, generator=g).to(dtype)
    want = moe_combine_forward(rows, weights, None, residual)
    dev = SplitRows(*(a.to(DEVICE) if a is not None else None for a in rows))
    assert tc.supported(dev, weights.to(DEVICE), None, residual.to(DEVICE))
    _close(tc.combine(dev, weights.to(DEVICE), None, residual.to(DEVICE)).cpu(), want)


def test_combine_leaves_other_layouts_to_torch():
    rows = torch.zeros(8, 64)
    w = torch.zeros(1, 8)
    assert not tc.supported(rows, w.to(torch.bfloat16))                     # dtypes differ
    assert not tc.supported(rows, torch.zeros(2, 8))                        # rows are not T*k
    assert not tc.supported(torch.zeros(64, 8).t(), w)                      # not contiguous
    assert not tc.supported(SplitRows(rows, torch.zeros(7, dtype=torch.long), rows), w)   # slots != pairs


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 37), (2, 4, 128)])
def test_add_rms_norm_is_the_add_then_the_norm(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    res = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    want_s, want_y = add_rms_norm_forward(x, res, w, 1e-6)
    s, y = tn.add_rms_norm(x.to(DEVICE), res.to(DEVICE), w.to(DEVICE), 1e-6)
    if COMPILED or dtype == torch.float32:
        assert torch.equal(s.cpu(), want_s)                 # the sum: one rounding, as torch's add
    else:
        assert (s.cpu().float() - want_s.float()).abs().max() <= REL16 * want_s.float().abs().max()
    # bitwise the separate kernel applied to the sum it wrote, and within one rounding of the
    # reference norm of that sum (the same as want_y wherever the sums agree)
    assert torch.equal(y, tn.rms_norm(s, w.to(DEVICE), 1e-6))
    ref_y = rms_norm_forward(s.cpu(), w, 1e-6).float()
    rel = 1e-6 if dtype == torch.float32 else REL16
    assert bool(((y.cpu().float() - ref_y).abs() <= rel * ref_y.abs() + 1e-6).all())
    if COMPILED or dtype == torch.float32:
        assert torch.equal(ref_y, want_y.float())


def test_kernel_choice_for_ab_runs(monkeypatch):
    """FREETOKEN_GPU_DECODE_KERNELS: on, off, or the kernels to keep (the bench's A/B sides);
    a misspelt name is refused, not silently ignored."""
    from freetoken_engine import env
    for value, want in [("on", set(env.GPU_DECODE_KERNELS)), ("off", set()),
                        ("attention, norm,route", {"attention", "norm", "route"})]:
        monkeypatch.setenv(env.FREETOKEN_GPU_DECODE_KERNELS, value)
        assert env.gpu_decode_kernels() == want
    monkeypatch.setenv(env.FREETOKEN_GPU_DECODE_KERNELS, "norm,combin")
    with pytest.raises(ValueError, match="combin"):
        env.gpu_decode_kernels()
