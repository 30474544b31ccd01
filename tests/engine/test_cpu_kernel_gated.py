"""The compiled CPU expert kernel on experts of another kind (gpt-oss: gate/up biases and the
clamped gate, ``cpu_experts.gated_forward``) against the PyTorch reference, with test_cpu_kernel's
tolerance (fp32 x: 1e-4 max|ref| + 1e-5; bf16 x: 2e-2 max|ref|), on every instruction set this CPU
has, the AMX tiles included where present."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels import reference
from freetoken_engine.kernels.reference import GatedAct, expert_pairs_forward
from test_cpu_kernel import SHAPES, _close, _isas, _problem, kernel_config  # noqa: F401  (a fixture)

OAI = GatedAct("swiglu_oai", 1.702, 0.9)


def _biases(E: int, I: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(E, 2 * I, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("act", [OAI, reference.SILU], ids=["oai", "silu"])
@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16], ids=["w32", "wbf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d_H%d_I%d_E%d_P%d" % s)
def test_gated_experts_match_reference_on_every_isa(kernel_config, monkeypatch, shape, xd, wd, act):
    """Biased gate/up rows and the clamped gate (limit 0.9: most rows clamp), the bias row of each
    pair its expert's while the weights are indexed by slot (here the bank reversed), and the
    compiled kernel's result, not the reference's."""
    x, w13, w2, tok, exp = _problem(*shape, xd, wd)
    E, I = w13.shape[0], w2.shape[2]
    b13 = _biases(E, I).to(xd)
    want = expert_pairs_forward(x, w13, w2, tok, exp, act, b13)
    assert (want - expert_pairs_forward(x, w13, w2, tok, exp)).abs().max() > 0.1     # the kind matters
    monkeypatch.setattr(reference, "expert_pairs_forward", None)                       # compiled only
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, w13, w2, tok, exp, act=act, b13=b13), want)
        slots = E - 1 - exp
        _close(ce.experts_forward(x, w13.flip(0), w2.flip(0), tok, slots, act=act, b13=b13, pair_bias=exp), want)


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
def test_one_gated_expert_many_tokens(kernel_config, xd):
    """Prefill-like groups (the AMX tiles' case on a CPU that has them) plus a stray pair."""
    x, w13, w2, _, _ = _problem(40, 128, 64, 8, 1, xd, torch.bfloat16)
    tok = torch.cat([torch.arange(40), torch.tensor([4])])
    exp = torch.cat([torch.full((40,), 3), torch.tensor([7])])
    b13 = _biases(8, 64).to(xd)
    want = expert_pairs_forward(x, w13, w2, tok, exp, OAI, b13)
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, w13, w2, tok, exp, act=OAI, b13=b13), want)


def test_bad_gated_calls_raise_clear_errors(kernel_config):
    x, w13, w2, tok, exp = _problem(3, 64, 32, 4, 5, torch.float32, torch.float32)
    with pytest.raises(IndexError, match="bias row 9 out of range"):
        ce.experts_forward(x, w13, w2, tok, exp, act=OAI, b13=_biases(4, 32), pair_bias=torch.full_like(exp, 9))
    with pytest.raises(ValueError, match="b13 must be"):
        ce.experts_forward(x, w13, w2, tok, exp, act=OAI, b13=_biases(4, 16))
    with pytest.raises(ValueError, match="rows_from takes plain experts"):
        ce.experts_forward(x, w13, w2, tok, exp, rows_from=8, act=OAI)
