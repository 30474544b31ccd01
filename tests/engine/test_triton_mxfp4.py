"""The Triton MoE kernels on MXFP4 slots (kernels/mxfp4.py's rows, decoded where they are loaded)
against the reference on their dequantized values: one token (the lanes kernels), a few tokens
(grouping in the kernel) and many (the block table), plain and gpt-oss's experts, fp32 within 1e-5
and bf16 within the stated 2e-2; the fills' gather copies MXFP4 rows as bytes. On CPU under
TRITON_INTERPRET=1 (CI) and compiled on a GPU (tests/gpu)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.kernels import mxfp4  # noqa: E402
from freetoken_engine.kernels.reference import GatedAct, expert_pairs_forward  # noqa: E402
from freetoken_engine.kernels.triton.gather import gather_fill_rows  # noqa: E402
from freetoken_engine.kernels.triton import moe, moe_mx_dense  # noqa: E402
from freetoken_engine.kernels.triton.moe import SMALL_P, moe_slots_forward  # noqa: E402

H, I = 64, 96


def _pool(slots: int, seed: int = 0, h: int = H, i: int = I) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (mxfp4.quantize(torch.randn(slots, 2 * i, h, generator=g) * 0.1),
            mxfp4.quantize(torch.randn(slots, h, i, generator=g) * 0.1))


def _routing(tokens: int, k: int, slots: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.arange(tokens).repeat_interleave(k)
    slot = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)]).flatten()
    return tok, slot


@pytest.mark.parametrize("gated", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,k", [(1, 4), (4, 4), (40, 2)])   # lanes, in-kernel grouping, block table
def test_moe_on_mxfp4_slots_matches_the_reference(tokens, k, dtype, gated):
    q13, q2 = _pool(6)
    d13, d2 = mxfp4.dequantize(q13, torch.float32), mxfp4.dequantize(q2, torch.float32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    tok, slot = _routing(tokens, k, 6)
    slot[::5] = -1                                        # pairs computed on the CPU
    assert (tokens * k <= SMALL_P) == (tokens < 40)
    gpu = slot >= 0
    extra = {}
    if gated:
        extra = dict(act=GatedAct("swiglu_oai", 1.702, 0.5), b13=torch.randn(9, 2 * I, generator=g).to(dtype),
                     pair_bias=(slot * 7 + 3) % 9)
    out = moe_slots_forward(x, q13, q2, tok, slot, **extra)
    ref_extra = {} if not gated else dict(act=extra["act"], b13=extra["b13"].float(), pair_bias=extra["pair_bias"][gpu])
    ref = expert_pairs_forward(x.float(), d13, d2, tok[gpu], slot[gpu], **ref_extra)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and torch.all(out[~gpu] == 0)
    assert (out[gpu].float() - ref).abs().max() <= tol * ref.abs().max() + 1e-6


@pytest.mark.parametrize("tokens,k", [(1, 4), (4, 4), (40, 2)])
def test_mxfp4_rows_whose_codes_end_inside_a_step(tokens, k):
    """Widths of 5 and 7 blocks of 32 (rows of 96 and 128 bytes, 16 and 10 of them padding): the
    kernels' last step of code bytes is partly past the row and reads none of the scales or padding
    there as codes."""
    h, i = 160, 224
    q13, q2 = _pool(6, h=h, i=i)
    q13[..., h // 2 + h // 32:] = 255                    # padding the kernels must not read as codes
    q2[..., i // 2 + i // 32:] = 255
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3))
    tok, slot = _routing(tokens, k, 6)
    out = moe_slots_forward(x, q13, q2, tok, slot)
    ref = expert_pairs_forward(x, mxfp4.dequantize(q13, torch.float32), mxfp4.dequantize(q2, torch.float32), tok, slot)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("gated", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("tokens", [1, 3])          # the lanes kernels, the tiled ones
def test_every_code_and_scale(monkeypatch, tokens, gated):
    """Rows holding every code in every block, scales from 2^-127 (byte 0, a float32 subnormal) to
    2^12 and unequal from block to block, through the lanes kernels (each block's sum scaled once)
    and the tiled kernels (each value scaled): the reference's values to 1e-5 of the output's
    scale."""
    monkeypatch.setattr(moe, "LANES_TILES_MX", {**moe.LANES_TILES_MX, "bk1": 64, "bk2": 64})
    g = torch.Generator().manual_seed(5)
    q13, q2 = mxfp4.random_rows((5, 2 * I), H, g, (100, 140)), mxfp4.random_rows((5, H), I, g, (110, 130))
    q13[:, :, :H // 2] = (torch.arange(H // 2) * 17 % 256).to(torch.uint8)   # every code, each nibble
    q13[1, :, H // 2] = 0                                  # 2^-127: a subnormal scale in the first block
    q2[2, :, I // 2 + 1] = 0
    q13[3, :, H // 2 + 1] = 139
    d13, d2 = mxfp4.dequantize(q13, torch.float32), mxfp4.dequantize(q2, torch.float32)
    x = torch.randn(tokens, H, generator=g)
    tok = torch.arange(tokens).repeat_interleave(4)
    slot = torch.cat([torch.tensor([1, 3, -1, 2]).roll(t) for t in range(tokens)])
    extra = {} if not gated else dict(act=GatedAct("swiglu_oai", 1.702, 7.0), b13=torch.randn(5, 2 * I, generator=g))
    out = moe_slots_forward(x, q13, q2, tok, slot, **extra)
    gpu = slot >= 0
    ref_extra = {} if not gated else dict(act=extra["act"], b13=extra["b13"], pair_bias=slot[gpu])
    ref = expert_pairs_forward(x, d13, d2, tok[gpu], slot[gpu], **ref_extra)
    assert torch.all(out[~gpu] == 0)
    assert (out[gpu] - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_decoding_the_slots_a_call_uses_into_the_dense_scratch():
    """The used slots are ranked on the device (ascending ids, unused and CPU pairs left out) and
    each round's slots decode to exactly their values; places past the used slots stay as they were."""
    q13, _ = _pool(7)
    rank, order, count = moe_mx_dense.used_ranks(torch.tensor([5, 2, -1, 5, 0, 2]), 7)
    assert rank.tolist() == [2, 1, -1, 2, 0, 1] and order[:3].tolist() == [0, 2, 5] and count.item() == 3
    dst = torch.full((2, 2 * I, H), 7.0)
    moe_mx_dense.decode_slots(q13, order, count, 2, dst)             # the last used slot, then nothing
    assert torch.equal(dst[0], mxfp4.dequantize(q13[5], torch.float32)) and bool((dst[1] == 7).all())
    wide = _pool(2, h=160, i=96)[0]                     # 5 blocks a row: the last step partly past it
    one = torch.zeros(1, 2 * 96, 160, dtype=torch.bfloat16)
    moe_mx_dense.decode_slots(wide, torch.tensor([1, 0]), torch.tensor([2]), 0, one)
    assert torch.equal(one[0], mxfp4.dequantize(wide[1], torch.bfloat16))


@pytest.mark.parametrize("gated", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("per_round", [1, 4])
def test_a_large_call_computes_every_pair_once_from_rounds_of_the_dense_scratch(monkeypatch, per_round, dtype,
                                                                                gated):
    """A large call on MXFP4 slots that decodes them first (1 or 4 experts a round, 5 used slots of
    7, CPU pairs among them): each pair's row is the reference's, within the 4-bit kernels' own
    tolerance, and a CPU pair's row is left as it was (zero=False)."""
    monkeypatch.setattr(moe_mx_dense, "MX_DENSE_PAIRS", 1)
    monkeypatch.setattr(moe_mx_dense, "MX_SCRATCH_BYTES", per_round * 3 * H * I * dtype.itemsize)
    q13, q2 = _pool(7)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, H, generator=g).to(dtype)
    tok, slot = _routing(40, 2, 5)
    slot = torch.where(slot == 3, 6, slot)               # slots 0, 1, 2, 4, 6 used; 3 and 5 not
    slot[::7] = -1
    gpu = slot >= 0
    extra = {}
    if gated:
        extra = dict(act=GatedAct("swiglu_oai", 1.702, 0.5), b13=torch.randn(9, 2 * I, generator=g).to(dtype),
                     pair_bias=(slot * 7 + 3) % 9)
    out = torch.full((slot.numel(), H), float("nan"), dtype=dtype)
    moe_slots_forward(x, q13, q2, tok, slot, out=out, zero=False, experts=6, **extra)
    ref_extra = {} if not gated else dict(act=extra["act"], b13=extra["b13"].float(), pair_bias=extra["pair_bias"][gpu])
    d13, d2 = mxfp4.dequantize(q13, torch.float32), mxfp4.dequantize(q2, torch.float32)
    ref = expert_pairs_forward(x.float(), d13, d2, tok[gpu], slot[gpu], **ref_extra)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out[~gpu].isnan().all()
    assert (out[gpu].float() - ref).abs().max() <= tol * ref.abs().max() + 1e-6


def test_which_large_calls_decode_their_slots_first():
    """Pairs a usable slot at or above MX_DENSE_PAIRS, bf16 or float32 activations (fp16 does not
    hold every 4-bit value exactly)."""
    n = moe_mx_dense.MX_DENSE_PAIRS
    assert moe_mx_dense.wants_dense(n * 32, 4096, 32, torch.bfloat16)          # a prefill over a big pool
    assert not moe_mx_dense.wants_dense(n * 32 - 1, 4096, 32, torch.bfloat16)
    assert not moe_mx_dense.wants_dense(n * 32, 4096, None, torch.bfloat16)    # the pool's slots count
    assert moe_mx_dense.wants_dense(n * 32, 32, None, torch.float32)
    assert not moe_mx_dense.wants_dense(n * 32, 32, 32, torch.float16)


def test_mxfp4_slots_refuse_a_streamed_part_and_bad_rows():
    q13, q2 = _pool(3)
    x = torch.randn(1, H)
    tok, slot = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 2])
    with pytest.raises(ValueError, match="streamed part"):
        moe_slots_forward(x, q13, q2, tok, slot, limit=torch.tensor([8]))
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_slots_forward(x, q13[..., :-1], q2, tok, slot)


def test_gather_copies_mxfp4_rows():
    """A step's fills move MXFP4 experts as bytes: the listed slots hold the bank's rows exactly."""
    bank13 = torch.stack([_pool(4, seed=s)[0] for s in range(2)])       # [L=2, E=4, 2I, 17H/32]
    bank2 = torch.stack([_pool(4, seed=s)[1] for s in range(2)])
    slots13, slots2 = torch.zeros(3, *bank13.shape[2:], dtype=torch.uint8), torch.zeros(3, *bank2.shape[2:],
                                                                                       dtype=torch.uint8)
    gather_fill_rows(bank13, bank2, slots13, slots2, 1, torch.tensor([3, -1, 0]), torch.tensor([2, 1, 0]))
    assert torch.equal(slots13[2], bank13[1, 3]) and torch.equal(slots2[0], bank2[1, 0])
    assert not slots13[1].any()


@pytest.mark.parametrize("capacity,fraction,long", [(3, 0.5, False), (16, 0.0, False), (1, 1.0, False),
                                                    (3, 0.5, True), (3, 0.5, "rounds")])
def test_gpt_oss_in_four_bits_on_the_triton_path(tiny_checkpoint, tmp_path, monkeypatch, capacity, fraction, long):
    """gpt-oss as published with its experts kept in MXFP4: the bank, the cache's slots, the fills
    and the prefill's whole-layer buffers hold 4-bit rows, the Triton kernels decode them and the
    C++ host loop computes the CPU's pairs from them; the tokens of the dense torch path. "rounds":
    the long prompt's whole-layer calls decode their slots into a dense scratch, two experts a
    round (moe_mx_dense.py)."""
    from freetoken_engine import LLM, SamplingParams
    from test_gpt_oss import _as_mxfp4
    if long == "rounds":
        monkeypatch.setattr(moe_mx_dense, "MX_DENSE_PAIRS", 1)
        monkeypatch.setattr(moe_mx_dense, "MX_SCRATCH_BYTES", 2 * 3 * 64 * 64 * 4)
        calls = []
        monkeypatch.setattr(moe, "decode_slots", lambda *a, f=moe_mx_dense.decode_slots: calls.append(1) or f(*a))
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, _ = _as_mxfp4(src, tmp_path)
    prompt = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150] * (8 if long else 1)
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    want = LLM(mx, expert_backend="torch", expert_format="dense").generate(prompt, greedy).token_ids
    llm = LLM(mx, expert_backend="triton", expert_format="mxfp4", expert_cache_experts=capacity,
              cpu_expert_fraction=fraction)
    assert llm.runner.bank.mxfp4 and llm.runner.cache.w13.dtype == torch.uint8
    got = llm.generate(prompt, greedy)
    assert got.token_ids == want
    s = got.stats
    assert s["fills"] + s["cpu_computed"] == s["misses"] and s["hits"] + s["misses"] > 0
    if fraction > 0 and capacity < 16:
        assert llm.runner.experts.host_branch.br.totals["cpu_pairs"] > 0
    llm.runner.resize_expert_cache(2)
    llm.runner.cache.check_integrity(deep=True)
    assert llm.generate(prompt, greedy).token_ids == want
    if long == "rounds":
        assert calls
