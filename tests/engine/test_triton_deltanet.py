"""The Gated DeltaNet decode kernels (kernels/triton/deltanet.py) against the layer's torch path
(``GatedDeltaNet._singles`` and ``_gated_norm``). On CPU under TRITON_INTERPRET=1 (CI) and compiled
on a GPU (``TRITON_INTERPRET=0 pytest`` this file there): the states written in their slots and the
output within fp32 1e-5 relative; 16-bit within a few roundings of the data type (2^-6 relative of
the largest output; 2^-5 under the interpreter, which truncates instead of rounding)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from freetoken_engine.cache.states import StatePool  # noqa: E402
from freetoken_engine.config import LinearAttnConfig  # noqa: E402
from freetoken_engine.layers.batch import AttnBatch  # noqa: E402
from freetoken_engine.layers.deltanet import GatedDeltaNet  # noqa: E402
from freetoken_engine.layers.kda import KimiDeltaAttention  # noqa: E402
from freetoken_engine.layers.linear import linear  # noqa: E402
from freetoken_engine.kernels.triton import deltanet as td  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"


KDA = LinearAttnConfig(k_heads=4, v_heads=4, k_dim=16, v_dim=16, conv=4, kind="kda")


def layer_and_pool(lin: LinearAttnConfig, dtype, hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = (KimiDeltaAttention if lin.kind == "kda" else GatedDeltaNet)(hidden, lin, 0, 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    layer = layer.to(DEVICE, dtype)
    layer.fuse()
    pool = StatePool(1, lin, live=6, checkpoints=0, dtype=dtype, device=torch.device(DEVICE))
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=g) * 0.3)
    layer.states = pool
    return layer, pool


def kernel_inputs(layer, x):
    """The layer's convolution input, the rest of its projected rows as ``recurrent_step`` takes
    them, and that step for the layer's kind: ``step(y, rest, slots, chain=None)``."""
    proj = linear(x, layer.proj, None)                      # the layer's own projection
    if isinstance(layer, KimiDeltaAttention):
        mixed, b, fa, ga = proj.split(layer.sizes, -1)
        rest = torch.cat((layer.g_b_proj(ga), b, layer.f_b_proj(fa)), -1)

        def step(y, rows, slots, chain=None):
            return td.recurrent_step(y, rows, layer.states.ssm[0], slots, layer.neg_a.view(-1), layer.dt_bias,
                                     layer.o_norm.weight, layer.lin.k_heads, layer.eps, chain=chain, kda=True)
        return mixed, rest, step
    c = layer.sizes[0]

    def step(y, rows, slots, chain=None):
        return td.recurrent_step(y, rows, layer.states.ssm[0], slots, layer.neg_a, layer.dt_bias, layer.norm.weight,
                                 layer.lin.k_heads, layer.eps, chain=chain)
    return proj[:, :c], proj[:, c:], step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lin", [LinearAttnConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=16, conv=4),
                                 LinearAttnConfig(k_heads=2, v_heads=2, k_dim=32, v_dim=64, conv=3), KDA],
                         ids=["grouped", "wide", "kda"])
def test_decode_step_matches_the_torch_path(lin, dtype):
    layer, pool = layer_and_pool(lin, dtype)
    slots = torch.tensor([4, 1, 3], device=DEVICE)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    batch = AttnBatch(positions=None, slot_mapping=None, q_seq=None, q_idx=None, kv_index=None, kv_valid=None,
                      q_max=1, seq_counts=(1, 1, 1), seq_ends=(5, 9, 2), state_slots=tuple(slots.tolist()),
                      state_index=slots)
    conv0, ssm0 = pool.conv.clone(), pool.ssm.clone()
    want = layer(x, batch)                                  # the torch path (a CPU tensor, or kernels off)
    want_conv, want_ssm = pool.conv.clone(), pool.ssm.clone()
    pool.conv.copy_(conv0)
    pool.ssm.copy_(ssm0)
    mixed, rest, step = kernel_inputs(layer, x)
    y = td.conv_step(mixed, pool.conv[0], slots, layer.conv_w)
    got = (layer.out_proj if lin.kind != "kda" else layer.o_proj)(step(y, rest, slots))
    rel = 1e-5 if dtype == torch.float32 else (2.0 ** -6 if COMPILED else 2.0 ** -5)
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= rel * scale
    assert torch.equal(pool.conv, want_conv)                # the kept inputs shifted, the token appended
    assert (pool.ssm - want_ssm).abs().max() <= rel * want_ssm.abs().max()
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool.ssm[:, untouched], ssm0[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lin", [LinearAttnConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=16, conv=4), KDA],
                         ids=["gdn", "kda"])
def test_chained_rows_run_each_draft_token_from_the_state_before_it(dtype, lin):
    """A draft's verification as decode rows: rows 0-2 are three tokens of the sequence in slot 4
    (their states go to the snapshot slots 1 and 3, the last back to 4), row 3 a lone sequence in
    slot 2. Each chained row must equal the unchained kernels (tested above against the torch
    path) run a token at a time from the state the token before left, and every slot must hold
    the state after its row; a kernel that ran the rows side by side from slot 4 would not."""
    layer, pool = layer_and_pool(lin, dtype)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    src = torch.tensor([4, 4, 4, 2], device=DEVICE)
    dst = torch.tensor([1, 3, 4, 2], device=DEVICE)
    cont = torch.tensor([0, 1, 1, 0], device=DEVICE)
    mixed, rest, step = kernel_inputs(layer, x)        # one projection for both sides

    def recurrent(y, rows, slots, chain=None):
        return step(y, rest[rows], slots, chain=chain)
    conv0, ssm0 = pool.conv.clone(), pool.ssm.clone()
    # the reference: a row at a time in a work slot (5), its state copied out after each
    work, wants = torch.tensor([5], device=DEVICE), []
    for r, (s, d, cn) in enumerate(zip(src.tolist(), dst.tolist(), cont.tolist())):
        if not cn:
            pool.conv[:, 5], pool.ssm[:, 5] = pool.conv[:, s], pool.ssm[:, s]
        y = td.conv_step(mixed[r:r + 1], pool.conv[0], work, layer.conv_w)
        wants.append(recurrent(y, slice(r, r + 1), work))
        pool.conv[:, d], pool.ssm[:, d] = pool.conv[:, 5], pool.ssm[:, 5]
    want = torch.cat(wants)
    want_conv, want_ssm = pool.conv[:, :5].clone(), pool.ssm[:, :5].clone()
    pool.conv.copy_(conv0)
    pool.ssm.copy_(ssm0)
    y = td.conv_step(mixed, pool.conv[0], src, layer.conv_w, chain=(dst, cont))
    got = recurrent(y, slice(None), src, chain=(dst, cont))
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max()
    assert torch.equal(pool.conv[:, :5], want_conv)
    assert (pool.ssm[:, :5] - want_ssm).abs().max() <= 1e-5 * want_ssm.abs().max()
    assert torch.equal(pool.ssm[:, 0], ssm0[:, 0])             # a slot no row names is left alone
    side_by_side = (want_ssm[:, 3] - want_ssm[:, 1]).abs().max()
    assert side_by_side > 1e-3 * want_ssm.abs().max()          # the snapshots differ: the test can tell


def test_the_layer_takes_the_kernels_only_for_a_plain_decode_step():
    lin = LinearAttnConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=16, conv=4)
    layer, _ = layer_and_pool(lin, torch.float32)
    slots = torch.tensor([0, 1], device=DEVICE)

    def batch(**kw):
        base = dict(positions=None, slot_mapping=None, q_seq=None, q_idx=None, kv_index=None, kv_valid=None,
                    q_max=1, seq_counts=(1, 1), seq_ends=(5, 9), state_slots=(0, 1), state_index=slots)
        return AttnBatch(**{**base, **kw})
    x = torch.zeros(2, 32, device=DEVICE)
    on_gpu = DEVICE == "cuda"
    assert (layer._decode_kernels(x, batch()) is not None) == on_gpu
    assert layer._decode_kernels(x, batch(seq_ends=(1, 9))) is None               # a state that starts
    assert layer._decode_kernels(x, batch(snapshots=(((1, 5),), ()))) is None     # a checkpoint to copy
    assert layer._decode_kernels(x, batch(seq_counts=None, seq_ends=None)) is not None or not on_gpu


def chunk_inputs(n: int, h: int, dk: int, dv: int, seed: int):
    """A sequence's q, k (normalised), v, g, beta and an entering state, as the layer makes them."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)
    q = torch.nn.functional.normalize(rand(n, h, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rand(n, h, dk), dim=-1)
    g = -torch.nn.functional.softplus(rand(n, h)) * 0.3
    return [t.to(DEVICE) for t in (q, k, rand(n, h, dv), g, torch.sigmoid(rand(n, h)), rand(h, dk, dv) * 0.3)]


@pytest.mark.parametrize("n, h, dk, dv", [(40, 2, 16, 32), (70, 3, 32, 64), (16, 1, 16, 16)],
                         ids=["padded", "blocks", "one-chunk"])
def test_prefill_chunks_state_hand_over_matches_the_loop(n, h, dk, dv):
    """The kernel's outputs and final state against delta_rule_chunked's own loop: several chunks
    (the last padded), value blocks of 32 side by side, a state that enters non-zero."""
    from freetoken_engine.kernels.triton import deltanet_chunk as tc
    from freetoken_engine.layers.deltanet import delta_rule_chunked
    q, k, v, g, beta, state = chunk_inputs(n, h, dk, dv, seed=n)
    want_o, want_s = delta_rule_chunked(q, k, v, g, beta, state.clone(), chunk=16)
    got_o, got_s = delta_rule_chunked(q, k, v, g, beta, state.clone(), chunk=16, kernel=tc)
    assert got_o.shape == want_o.shape == (n, h, dv)
    assert (got_o - want_o).abs().max() <= 1e-5 * want_o.abs().max()
    assert (got_s - want_s).abs().max() <= 1e-5 * want_s.abs().max()
    assert (want_s - state).abs().max() > 0.1              # the state did move: the test can tell


def test_the_chunk_kernel_refuses_what_it_cannot_index():
    from freetoken_engine.kernels.triton import deltanet_chunk as tc
    assert tc.supported(128, 128, 64) and not tc.supported(8, 16, 64) and not tc.supported(96, 128, 64)
    x = torch.zeros(2, 1, 16, 32, device=DEVICE)
    wk = torch.zeros(2, 1, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="w: float32"):
        tc.chunk_states(x, wk.double(), wk, wk, wk, torch.ones(2, 1, device=DEVICE), torch.zeros(2, 16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="attn: float32"):
        tc.chunk_states(x, wk, wk, x, wk, torch.ones(2, 1, device=DEVICE), torch.zeros(2, 16, 32, device=DEVICE))


_SHARED_MEMORY = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken_engine.kernels.triton import deltanet_chunk as tc
jit = tc._states_kernel
unit = {"su2", "sw3", "sq3", "sa3", "sk3"}          # unit strides, as a launch specialises them
out = {}
for k_dim, arch, stages in ((128, 89, 1), (256, 89, 1), (128, 90, 2), (128, 90, 3)):
    sig = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in jit.arg_names}
    const = {"C": 64, "DK": k_dim, "DV": 256, "BV": 32, "PRECISION": "tf32x3", **{n: 1 for n in unit}}
    sig.update({n: "constexpr" for n in const})
    kernel = triton.compile(ASTSource(jit, sig, const), target=GPUTarget("cuda", arch, 32),
                            options={"num_stages": stages})
    out[f"{k_dim}/sm{arch}/{stages}"] = kernel.metadata.shared
print(json.dumps(out))
"""


def test_the_chunk_kernel_fits_a_consumer_cards_shared_memory():
    """Compiled for an RTX 4090 (sm_89, 99 KB of shared memory a block; ptxas ships with Triton, no
    GPU needed), in a process of its own (the interpreter's patches of triton.language would leak
    into a compile here): the one-stage form the kernel falls back to fits at the largest shapes
    it takes, and the two-stage form at Qwen3.6's fits a Hopper SM (227 KB). Triton's default
    three stages did not (256 KB, refused on the H200)."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _SHARED_MEMORY], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert shared["128/sm89/1"] <= 99 * 1024 and shared["256/sm89/1"] <= 99 * 1024
    assert shared["128/sm90/2"] <= 227 * 1024 < shared["128/sm90/3"]
