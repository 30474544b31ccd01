"""IBM Granite 4.0-H (``granitemoehybrid``: Mamba-2 layers beside attention, ``layers/mamba2.py``):
the chunked state-space form against its own recurrence; a packed folder and the expert cache
with q* giving transformers' tokens; configurations it cannot follow refused by name. Parity on
random checkpoints is in test_parity.py and test_hybrid.py (variants, a long prompt in odd
chunks), the scheduler's checkpoints and drafts in test_hybrid.py and test_speculative.py."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.layers.mamba2 import ssd_chunked, ssd_step, ssd_steps
from test_minimax_m2 import _edit
from test_parity import packed_and_cached
from tiny_models import copy_folder


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_the_chunked_form_equals_the_recurrence(n):
    """Across chunk boundaries and a padded last chunk, from a state that is not zero: the
    outputs and the final state of the chunked form are the recurrence's, token by token."""
    g = torch.Generator().manual_seed(n)
    h, p, s = 4, 6, 5
    x, b, c = torch.randn(n, h, p, generator=g), torch.randn(n, h, s, generator=g), torch.randn(n, h, s, generator=g)
    dt = torch.rand(n, h, generator=g) * 0.5
    a = -torch.rand(h, generator=g) * 2
    state0 = torch.randn(h, s, p, generator=g)
    want, state = [], state0[None]
    for t in range(n):
        y, state = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], state)
        want.append(y[0])
    got, got_state = ssd_chunked(x, dt, a, b, c, state0, chunk=64)
    assert (got - torch.stack(want)).abs().max() < 1e-4 and (got_state - state[0]).abs().max() < 1e-4
    few, few_state = ssd_steps(x, dt, a, b, c, state0)
    assert torch.equal(few, torch.stack(want)) and torch.equal(few_state, state[0])


def test_a_packed_folder_and_the_expert_cache_give_transformers_tokens(tiny_checkpoint, tmp_path):
    """``freetoken convert`` folds the residual multiplier into Mamba-2's ``out_proj`` as it does
    into the other branch ends; the expert cache and q* change no token."""
    packed_and_cached(tiny_checkpoint("granitemoehybrid"), tmp_path / "packed")


@pytest.mark.parametrize("change,says", [
    ({"layer_types": ["mamba", "attention", "conv", "mamba"]}, "layer_types must name each of the 4 layers"),
    ({"mamba_d_head": 12}, "mamba_n_heads 4 x mamba_d_head 12 must equal mamba_expand x hidden_size"),
    ({"mamba_n_groups": 3}, "mamba_n_heads must be a multiple of mamba_n_groups"),
    ({"shared_intermediate_size": 0}, "needs shared_intermediate_size"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("granitemoehybrid"), tmp_path / "g"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
