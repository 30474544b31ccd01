"""bench/router_guess.py, which measures how well layer l + 1's experts are guessed one layer
early (the figure that decides cross-layer prefetch): its recall counts what it should, on a
real transformers llama split into experts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
router_guess = pytest.importorskip("router_guess")

from freetoken_engine.convert.evaluate import install_moe  # noqa: E402

E, K, LAYERS, INTER = 8, 2, 3, 32


def _moe_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).float().eval()
    perms = torch.stack([torch.randperm(INTER) for _ in range(LAYERS)])
    mlps = install_moe(model, perms, torch.randn(LAYERS, E, 32), K)
    return model, mlps


def test_recall_is_the_share_of_the_chosen_experts_inside_the_guess():
    actual = torch.tensor([[1, 2], [3, 4], [5, 6]])
    guess = torch.tensor([[2, 7, 1], [3, 0, 0], [0, 0, 0]])
    assert router_guess.recall(guess, actual, torch.ones(3, dtype=torch.bool)) == pytest.approx(0.5)
    assert router_guess.recall(guess, actual, torch.tensor([True, False, False])) == 1.0


def test_a_repeated_token_guesses_itself_and_window_starts_are_left_out():
    """Within a window of one repeated token every position's hidden states are the same (the
    values it attends to are equal), so the token before chose exactly the same experts; the
    second window's first token follows another token, which the previous-token guess skips."""
    model, mlps = _moe_llama()
    got = router_guess.measure(model, mlps, [[5] * 6, [9] * 6], K, [0, E - K])
    assert got["0"]["mean"]["previous token"] == 1.0
    assert len(got["0"]["per_layer"]["own input"]) == LAYERS - 1
    for source in router_guess.SOURCES:            # a guess of every expert finds every one
        assert got[str(E - K)]["mean"][source] == 1.0
        assert 0.0 <= got["0"]["mean"][source] <= 1.0
    assert got["0"]["random"] == K / E


def test_the_own_input_guess_is_the_next_routers_choice_on_this_layers_input():
    """With every layer's router and norm weights the same and the next layer's router input
    made this layer's (the MLP and attention outputs zeroed), the engine's guess is always right."""
    model, mlps = _moe_llama()
    router, weight = torch.randn(E, 32), torch.rand(32) * 4 + 0.1
    for m in mlps:
        m.router = router
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.data.zero_()
        layer.self_attn.o_proj.weight.data.zero_()
        layer.post_attention_layernorm.weight.data.copy_(weight)
    got = router_guess.measure(model, mlps, [[3, 8, 1, 30, 12, 7]], K, [0])
    assert got["0"]["mean"]["own input"] == 1.0
    assert got["0"]["mean"]["next norm"] == 1.0
