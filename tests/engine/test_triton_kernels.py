"""Triton kernels against the PyTorch reference, on CPU under TRITON_INTERPRET=1 (small shapes)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.kernels.reference import expert_pairs_forward
from freetoken_engine.kernels.triton.gather import gather_fill_rows
from freetoken_engine.kernels.triton.moe import SMALL_P, moe_slots_forward

H, I = 64, 48


def _pool(slots: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(slots, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(slots, H, I, generator=g) * 0.1).to(torch.bfloat16)
    return w13, w2


def _routing(tokens: int, k: int, slots: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.arange(tokens).repeat_interleave(k)
    slot = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)]).flatten()
    return tok, slot


@pytest.mark.parametrize("tokens,k", [(1, 4), (4, 4), (40, 2)])   # in-kernel grouping and block table
def test_moe_slots_matches_reference_fp32(tokens, k):
    w13, w2 = _pool(6)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    tok, slot = _routing(tokens, k, 6)
    assert (tokens * k <= SMALL_P) == (tokens < 40)       # both kernel paths are exercised
    out = moe_slots_forward(x, w13, w2, tok, slot)
    ref = expert_pairs_forward(x, w13.float(), w2.float(), tok, slot)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_moe_slots_bf16_within_tolerance_and_cpu_pairs_zero():
    """bf16 activations: the stated tolerance is 2e-2 relative to the output scale."""
    w13, w2 = _pool(5)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    tok, slot = _routing(4, 3, 5)
    slot[::4] = -1                                        # pairs computed on the CPU
    out = moe_slots_forward(x, w13, w2, tok, slot)
    gpu = slot >= 0
    ref = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok[gpu], slot[gpu])
    assert out.dtype == torch.bfloat16
    assert torch.all(out[~gpu] == 0)
    err = (out[gpu].float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2
    # zero=False (the engine's call: its combine selects per pair) computes the same device rows
    buf = torch.full_like(out, 7.0)
    moe_slots_forward(x, w13, w2, tok, slot, out=buf, zero=False)
    assert torch.equal(buf[gpu], out[gpu]) and torch.all(buf[~gpu] == 7.0)


@pytest.mark.parametrize("tiles", [None, {"bn1": 32, "bk1": 32, "bn2": 32, "bk2": 32, "warps": 4}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_lanes_kernels_match_the_reference_and_the_tiled_kernels(monkeypatch, dtype, tiles):
    """A batch-1 call (one token, the engine's decode at batch 1) takes the lanes kernels: the
    same rows as the reference (fp32 1e-5; bf16 within the stated 2e-2) and as the tiled kernels,
    zero rows for the CPU's pairs, and only rows [0, limit) of each expert with ``limit``. The
    second tiles leave partial blocks of rows and of K (I = 48, blocks of 32)."""
    from freetoken_engine.kernels.triton import moe
    if tiles is not None:
        monkeypatch.setattr(moe, "LANES_TILES", tiles)
    w13, w2 = (w.to(dtype) for w in _pool(6, seed=4))
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    tok = torch.zeros(6, dtype=torch.int64)
    slot = torch.tensor([4, -1, 0, 5, -1, 2])
    gpu = slot >= 0
    out = moe_slots_forward(x, w13, w2, tok, slot)
    ref = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok[gpu], slot[gpu])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and torch.all(out[~gpu] == 0)
    assert (out[gpu].float() - ref).abs().max() <= tol * ref.abs().max()
    monkeypatch.setattr(moe, "LANES_TILES", None)
    tiled = moe_slots_forward(x, w13, w2, tok, slot)
    assert (out.float() - tiled.float()).abs().max() <= tol * ref.abs().max()
    monkeypatch.undo()
    if tiles is not None:
        monkeypatch.setattr(moe, "LANES_TILES", tiles)
    r = 20
    part = moe_slots_forward(x, w13, w2, tok, slot, limit=torch.tensor([r]))
    cut13 = torch.cat([w13[:, :r], w13[:, I:I + r]], 1)
    ref_part = expert_pairs_forward(x.float(), cut13.float(), w2[:, :, :r].float(), tok[gpu], slot[gpu])
    assert (part[gpu].float() - ref_part).abs().max() <= tol * ref_part.abs().max()


def test_moe_slots_rejects_bad_strides_and_shapes():
    w13, w2 = _pool(3)
    x = torch.randn(2, H)
    tok, slot = _routing(2, 2, 3)
    with pytest.raises(ValueError, match="unit stride"):
        moe_slots_forward(x.t().contiguous().t(), w13, w2, tok, slot)
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_slots_forward(x, w13, w2[:, :, :-1], tok, slot)
    with pytest.raises(ValueError, match="pairs"):
        moe_slots_forward(x, w13, w2, tok, slot[:-1])


def test_gather_fill_rows_copies_listed_experts_only():
    layers, experts, slots = 3, 5, 4
    bank13 = torch.randn(layers, experts, 2 * I, H).to(torch.bfloat16)
    bank2 = torch.randn(layers, experts, H, I).to(torch.bfloat16)
    w13, w2 = torch.zeros(slots, 2 * I, H, dtype=torch.bfloat16), torch.zeros(slots, H, I, dtype=torch.bfloat16)
    fill_exp = torch.tensor([4, 0, -1, -1])
    fill_slot = torch.tensor([2, 1, -1, -1])
    gather_fill_rows(bank13, bank2, w13, w2, 1, fill_exp, fill_slot, chunks=3, block=256)
    assert torch.equal(w13[2], bank13[1, 4]) and torch.equal(w2[2], bank2[1, 4])
    assert torch.equal(w13[1], bank13[1, 0]) and torch.equal(w2[1], bank2[1, 0])
    assert torch.all(w13[[0, 3]] == 0) and torch.all(w2[[0, 3]] == 0)
    with pytest.raises(ValueError, match="row shapes"):
        gather_fill_rows(bank13, bank2, w13[:, :, :-4], w2, 1, fill_exp, fill_slot)


@pytest.mark.parametrize("tokens,k", [(1, 4), (4, 4), (40, 2)])   # lanes, in-kernel grouping, block table
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_experts_with_biases_match_the_reference(tokens, k, dtype):
    """gpt-oss's experts (gate/up biases, the clamped gate with a limit that bites): each pair's
    bias row is its expert's (``pair_bias``), not its slot's; fp32 1e-5, bf16 the stated 2e-2; CPU
    pairs (slot -1) untouched."""
    from freetoken_engine.kernels.reference import GatedAct
    act = GatedAct("swiglu_oai", 1.702, 0.5)
    w13, w2 = (w.to(dtype) for w in _pool(6))
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(tokens, H, generator=g) * 3).to(dtype)
    b13 = torch.randn(9, 2 * I, generator=g).to(dtype)
    tok, slot = _routing(tokens, k, 6)
    slot[::5] = -1
    expert = (slot * 7 + 3) % 9                           # the pairs' experts: rows of b13
    gpu = slot >= 0
    out = moe_slots_forward(x, w13, w2, tok, slot, act=act, b13=b13, pair_bias=expert)
    ref = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok[gpu], slot[gpu], act, b13.float(), expert[gpu])
    plain = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok[gpu], slot[gpu])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out[gpu].float() - ref).abs().max() <= tol * ref.abs().max() + 1e-6
    assert (plain - ref).abs().max() > 0.2 * ref.abs().max() and torch.all(out[~gpu] == 0)
    with pytest.raises(ValueError, match="b13 must be"):
        moe_slots_forward(x, w13, w2, tok, slot, act=act, b13=b13[:, :I], pair_bias=expert)
