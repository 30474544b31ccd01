"""The compiled CPU expert kernel on a prompt's calls: many tokens on one expert, in more groups
than a register block holds, and rows larger than a core's L2 (experts_isa.cpp's spans). The
helpers and the tolerance are test_cpu_kernel.py's."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels.reference import expert_pairs_forward
from test_cpu_kernel import _close, _isas, _problem, kernel_config  # noqa: F401 (a fixture)


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
def test_one_expert_many_tokens(kernel_config, xd):
    """More tokens on one expert than a register block holds (prefill-like), plus a stray pair."""
    x, w13, w2, _, _ = _problem(21, 128, 48, 8, 1, xd, torch.bfloat16)
    tok = torch.cat([torch.arange(21), torch.tensor([4])])
    exp = torch.cat([torch.full((21,), 3), torch.tensor([7])])
    ref = expert_pairs_forward(x, w13, w2, tok, exp)
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, w13, w2, tok, exp), ref)


@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16], ids=["w32", "wbf16"])
def test_a_prompts_token_groups_pass_each_span_of_rows(kernel_config, wd):
    """A prompt-sized call: 37 tokens on one expert (five groups of up to 8) whose gate and up
    rows (3-6 MB) exceed a core's L2, so the kernel passes them in spans, every group over each
    span before the next. Within tolerance of the reference, and each token's row bit for bit
    what the same tokens get in a call of their own: the spans change the order of the work, not
    of any sum."""
    x, w13, w2, _, _ = _problem(37, 2048, 384, 2, 1, torch.float32, wd)
    tok, exp = torch.arange(37), torch.ones(37, dtype=torch.long)
    ref = expert_pairs_forward(x, w13, w2, tok, exp)
    for isa in _isas():
        ce.configure(isa=isa)
        y = ce.experts_forward(x, w13, w2, tok, exp)
        _close(y, ref)
        alone = ce.experts_forward(x, w13, w2, tok[8:16], exp[8:16])
        assert torch.equal(y[8:16], alone), isa
