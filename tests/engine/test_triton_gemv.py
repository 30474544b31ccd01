"""The GPU decode GEMV (kernels/triton/gemv.py) against ``F.linear``: on CPU under
TRITON_INTERPRET=1 (CI) and compiled on a GPU (``TRITON_INTERPRET=0 pytest`` this file there).
fp32 within 1e-5 (|x| . |w|) + 1e-6 of the fp32 reference; 16-bit one rounding of the fp32 sum,
2^-8 relative plus 1e-5 (|x| . |w|) (2^-7 under the interpreter, which truncates)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from freetoken_engine.kernels.triton import gemv  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"
REL16 = 2.0 ** -8 if COMPILED else 2.0 ** -7
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _problem(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(got, x, w, b):
    """got against the fp32 reference of the same inputs, within the module's tolerance."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    scale = x.float().abs() @ w.float().abs().T                      # |x| . |w| per element
    assert got.dtype == x.dtype and got.shape == ref.shape
    err = (got.cpu().float() - ref).abs()
    if x.dtype == torch.float32:
        assert (err <= 1e-5 * scale + 1e-6).all(), err.max()
    else:
        assert (err <= REL16 * ref.abs() + 1e-5 * scale + 1e-6).all(), err.max()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,bias", [
    (1, 64, 512, False),      # one token, K a multiple of the block
    (3, 130, 100, True),      # K not a multiple of 32, rows not of the block, a bias
    (4, 7, 2560, False),      # fewer rows than a block; K past one block of 2048
    (9, 40, 300, False),      # a decode batch past the first graphs' four
    (16, 33, 64, True),       # the most tokens it takes
    (1, 96, 4096, True),      # two blocks of 2048 (the output projection of Qwen3-30B-A3B)
], ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["default", "lanes", "mma"])
def test_gemv_matches_f_linear(m, n, k, bias, dtype, kind):
    x, w, b = _problem(m, n, k, dtype, bias)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w, b)]
    assert gemv.supported(*dev)
    config = {"default": None, "lanes": ("lanes",) + gemv.blocks(m, k), "mma": ("mma", 16, 64, 2, 3)}[kind]
    _check(gemv.linear(*dev, config=config), x, w, b)


def test_strided_rows_of_x_and_w():
    """Views with a row stride (a slice of a wider buffer) read the right elements."""
    x, w, b = _problem(2, 40, 96, torch.bfloat16, True, seed=1)
    xw = torch.zeros(2, 160, dtype=torch.bfloat16)
    xw[:, 32:128] = x
    ww = torch.zeros(40, 128, dtype=torch.bfloat16)
    ww[:, :96] = w
    xv, wv = xw.to(DEVICE)[:, 32:128], ww.to(DEVICE)[:, :96]
    assert gemv.supported(xv, wv, b.to(DEVICE))
    _check(gemv.linear(xv, wv, b.to(DEVICE)), x, w, b)


def test_a_token_computes_the_same_with_two_to_sixteen_tokens():
    """The engine's configuration for 2-16 tokens (the tensor-core kernel) keeps each token's
    column to itself: its result does not depend on the others in the batch (within 1e-6: the
    interpreter's matmul may block columns differently; bitwise on a GPU)."""
    x, w, _ = _problem(16, 72, 2048, torch.float32, False, seed=2)
    configs = {gemv.default_config(m, 2048) for m in range(2, gemv.MAX_TOKENS + 1)}
    assert gemv.MAX_TOKENS == 16 and len(configs) == 1 and next(iter(configs))[0] == "mma"
    xd, wd = x.to(DEVICE), w.to(DEVICE)
    full = gemv.linear(xd, wd)
    for m in (2, 3, 4, 5, 8, 15):
        got = gemv.linear(xd[:m], wd)
        if COMPILED:
            assert torch.equal(got, full[:m])
        assert torch.allclose(got, full[:m], rtol=1e-6, atol=1e-6)


def test_what_it_does_not_compute_is_left_to_torch():
    x, w, b = _problem(2, 16, 32, torch.bfloat16, True)
    assert not gemv.supported(torch.zeros(17, 32, dtype=torch.bfloat16), w)          # a prefill chunk
    assert not gemv.supported(x.float(), w)                                           # mixed dtypes
    assert not gemv.supported(x, w, b.float())
    assert not gemv.supported(x.unsqueeze(0), w)                                      # 3-D
    assert not gemv.supported(x, w.t().contiguous().t())                              # K not unit stride
    assert not gemv.supported(torch.zeros(2, 16, dtype=torch.bfloat16), w)            # K mismatch
    assert not gemv.supported(x.to(torch.int32), w.to(torch.int32))
    wg = w.float().requires_grad_()
    assert not gemv.supported(x.float(), wg)                                          # autograd
    with torch.no_grad():
        assert gemv.supported(x.float(), wg)
