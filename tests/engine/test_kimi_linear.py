"""Kimi-Linear (``kimi_linear``: Kimi Delta Attention layers, ``layers/kda.py``, beside latent
attention without position encoding): the chunked form against its own recurrence; the config as
Moonshot publishes it (layers named from one in ``linear_attn_config``, the MoE in its own words)
giving transformers' tokens; a packed folder and the expert cache with q* giving transformers'
tokens; configurations it cannot follow refused by name. Parity on random checkpoints is also in
test_parity.py, the scheduler's checkpoints and drafts in test_hybrid.py and test_speculative.py."""
from __future__ import annotations

import json

import pytest
import torch

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.layers.deltanet import delta_rule_step, delta_rule_steps
from freetoken_engine.layers.kda import kda_chunked
from test_minimax_m2 import _edit
from test_parity import check, packed_and_cached
from tiny_models import copy_folder


def inputs(n: int, h: int = 3, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(n, h, d, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(n, h, d, generator=g)
    decay = -torch.rand(n, h, d, generator=g) * 3        # one per channel, some steep
    beta = torch.rand(n, h, generator=g)
    return q, k, v, decay, beta, torch.randn(h, d, d, generator=g)


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_the_chunked_form_equals_the_recurrence(n):
    """Across chunk boundaries and a padded last chunk, from a state that is not zero, with decays
    that differ per channel: outputs and final state as the recurrence gives them token by token."""
    q, k, v, decay, beta, state0 = inputs(n)
    want, s = [], state0[None]
    for t in range(n):
        o, s = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s)
        want.append(o[0])
    got, state = kda_chunked(q, k, v, decay, beta, state0)
    assert (got - torch.stack(want)).abs().max() < 1e-4 and (state - s[0]).abs().max() < 1e-4
    few, few_state = delta_rule_steps(q, k, v, decay, beta, state0)
    assert torch.equal(few, torch.stack(want)) and torch.equal(few_state, s[0])


def test_each_channel_decays_by_its_own_gate():
    """One channel forgotten, the others kept: the state's rows differ as the decays say (a
    per-head decay would treat the rows alike)."""
    q, k, v, decay, beta, state0 = inputs(1, h=1, d=4)
    decay = torch.tensor([[[0.0, 0.0, -50.0, 0.0]]])
    _, state = delta_rule_step(q, k, v, decay, beta * 0, state0[None])
    assert torch.equal(state[0, 0, [0, 1, 3]], state0[0, [0, 1, 3]]) and state[0, 0, 2].abs().max() < 1e-20


def test_the_published_config_form_gives_the_same_tokens(tiny_checkpoint, tmp_path):
    """Kimi-Linear-48B's config.json: ``linear_attn_config`` names the layers from one (and the
    heads, head size and convolution), the MoE keys are Moonshot's; the same weights, the same tokens."""
    src = tiny_checkpoint("kimi_linear")
    cfg = json.loads((src / "config.json").read_text())
    kinds = cfg.pop("layer_types")
    published = dict(cfg, linear_attn_config={
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "num_heads": cfg.pop("linear_num_heads"), "head_dim": cfg.pop("linear_head_dim"),
        "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")})
    folder = copy_folder(src, tmp_path / "k")
    (folder / "config.json").write_text(json.dumps(published))
    assert LLM(folder).runner.mcfg.linear_layers == LLM(src).runner.mcfg.linear_layers == (0, 2, 3)
    check(folder, n_new=12, ref_folder=src)


def test_a_packed_folder_and_the_expert_cache_give_transformers_tokens(tiny_checkpoint, tmp_path):
    packed_and_cached(tiny_checkpoint("kimi_linear"), tmp_path / "packed")


@pytest.mark.parametrize("change,says", [
    ({"layer_types": ["linear_attention", "full_attention", "sliding_attention", "linear_attention"]},
     "layer_types must name each of the 4 layers"),
    ({"layer_types": None, "linear_attn_config": {"kda_layers": [1, 3, 4], "full_attn_layers": [5]}},
     r"linear_attn_config.full_attn_layers names layer 5 of 4 \(counted from 1\)"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must name each of the 4 layers"),
    ({"mla_use_nope": False}, "mla_use_nope false"),
])
def test_configurations_it_cannot_follow_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = _edit(copy_folder(tiny_checkpoint("kimi_linear"), tmp_path / "k"), change)
    with pytest.raises(ConfigError, match=says):
        LLM(folder)
