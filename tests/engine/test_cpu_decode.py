"""Compiled decode kernels (kernels/cpu/linear.py, norm.py, attention.py) against the PyTorch
reference (kernels/reference.py), on every instruction set this CPU runs.

Tolerances (the modules' contracts): projection fp32 ``|y - ref| <= 1e-5 (|x|.|w|) + 1e-6`` per
element (summation order only), bf16 ``|y - ref32| <= 2^-8 |ref32| + 1e-5 (|x|.|w|)`` against the
fp32 reference of the same bf16 inputs (one final rounding); RMSNorm fp32 ``|y - ref| <= 1e-6 |ref| + 1e-6``,
bf16 ``|y - ref| <= 2^-7 |ref| + 1e-6``; attention
fp32 ``|y - ref| <= 1e-5 max|ref| + 1e-6``, bf16 ``|y - ref32| <= 2^-7 max|ref32|`` against the
fp32 reference of the same inputs; the K/V written to the cache equal the reference's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels.cpu import attention as ca
from freetoken_engine.kernels.cpu import linear as cl
from freetoken_engine.kernels.cpu.norm import rms_norm
from freetoken_engine.kernels.reference import decode_attention_forward, linear_forward, rms_norm_forward
from freetoken_engine.layers.linear import Linear, use_compiled_linears
from attention_cases import CASES, PARTIAL, attention_problem, references  # noqa: E402

pytestmark = pytest.mark.skipif(not ce.available(), reason="compiled CPU kernel unavailable")


@pytest.fixture
def isas():
    before = ce.configure()
    best = ce.cpu_features()["best_isa"]
    yield ce.ISAS[: ce.ISAS.index(best) + 1]
    ce.configure(threads=before.threads, isa=before.isa)


def _check_linear(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref32 = linear_forward(x.float(), w.float(), None if b is None else b.float())
    mag = x.float().abs() @ w.float().abs().T + (0 if b is None else b.float().abs())
    assert y.shape == ref32.shape and y.dtype == x.dtype
    if x.dtype == torch.float32:
        tol = 1e-5 * mag + 1e-6
    else:
        tol = 2.0 ** -8 * ref32.abs() + 1e-5 * mag
    err = (y.float() - ref32).abs()
    assert bool((err <= tol).all()), f"max error {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


LINEAR_SHAPES = [(1, 64, 16), (1, 1000, 37), (3, 257, 129), (8, 576, 1000), (5, 1024, 3072)]   # T, K, N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=lambda s: "T%d_K%d_N%d" % s)
def test_linear_matches_reference(isas, shape, bias, dtype):
    t, k, n = shape
    g = torch.Generator().manual_seed(t * k + n)
    x = torch.randn(t, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    for isa in isas:
        ce.configure(isa=isa)
        _check_linear(cl.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("tokens", [1, 5, cl.MAX_TOKENS + 3])
def test_bfloat16_weights_under_float32_tokens_match_the_widened_weights(isas, tokens, bias):
    """A CPU engine computing in float32 keeps a bfloat16 checkpoint's projections in bfloat16:
    the kernel reads them for float32 tokens (decode), F.linear gets them widened (prefill); either
    way the float32 result of the same values (models/build)."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 576, generator=g)
    w = (torch.randn(1000, 576, generator=g) / 24).to(torch.bfloat16)
    b = torch.randn(1000, generator=g).to(torch.bfloat16) if bias else None
    for isa in isas:
        ce.configure(isa=isa)
        y = cl.linear(x, w, b)
        assert y.dtype == torch.float32
        _check_linear(y, x, w.float(), None if b is None else b.float())
    # a float32 bias beside bfloat16 weights (a checkpoint that stores them so) still adds up
    y = cl.linear(x, w, torch.ones(1000))
    _check_linear(y, x, w.float(), torch.ones(1000))


def test_linear_strided_rows_and_threads_give_the_same_bits(isas):
    """A weight view with a row stride (a slice of a fused matrix) is read in place, and the
    result does not depend on the thread count."""
    big = torch.randn(300, 200).to(torch.bfloat16)
    w = big[:, 8:136]                                   # [300, 128], row stride 200
    x = torch.randn(2, 128).to(torch.bfloat16)
    ce.configure(threads=1)
    one = cl.linear(x, w)
    ce.configure(threads=2)
    assert torch.equal(cl.linear(x, w), one)
    _check_linear(one, x, w, None)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_l2_prefetch_and_row_groups_of_decode_projections_move_no_bit(isas, x_dtype):
    """Decode's projections of 1-4 tokens prefetch their rows into L2 as well (tune.h
    linear_far_pf, linear_far_tokens), and float32 tokens take bf16 rows four or two at a time
    (linear_pair_tokens, linear_row_group): the same bits at any distance, token limit or
    grouping, on every instruction set, up to the matrix's last row and column."""
    knobs = ce.tune()
    w = torch.randn(515, 650).to(torch.bfloat16)     # odd rows: a chunk's last rows ungrouped; a tail
    try:
        for isa in isas:
            ce.configure(threads=2, isa=isa)
            for tokens in (1, 2, 3, 4, 5, 8):
                x = torch.randn(tokens, 650).to(x_dtype)
                ce.tune(**knobs)
                want = cl.linear(x, w)
                _check_linear(want, x, w if x_dtype == torch.bfloat16 else w.float(), None)
                for setting in ({"linear_far_pf": 0}, {"linear_far_pf": 16}, {"linear_far_tokens": 8},
                                {"linear_pair_tokens": 1 << 20}, {"linear_pair_tokens": 3},
                                {"linear_row_group": 2}):
                    ce.tune(**{**knobs, **setting})
                    assert torch.equal(cl.linear(x, w), want), (isa, tokens, setting)
    finally:
        ce.tune(**knobs)


def test_linear_other_cases_are_exactly_f_linear():
    """Prefill-sized batches, other dtypes and autograd go to F.linear unchanged."""
    w = torch.randn(48, 32)
    x = torch.randn(cl.MAX_TOKENS + 1, 32)
    assert torch.equal(cl.linear(x, w), torch.nn.functional.linear(x, w))
    x = torch.randn(1, 32, dtype=torch.float64)
    assert torch.equal(cl.linear(x, w.double()), torch.nn.functional.linear(x, w.double()))
    wg = w.clone().requires_grad_()
    y = cl.linear(torch.randn(1, 32), wg)
    assert y.requires_grad


def test_model_linears_are_swapped_in_place():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
    x = torch.randn(1, 16)
    with torch.inference_mode():
        want = model(x)
        assert use_compiled_linears(model) == 2
        assert all(isinstance(m, Linear) for m in (model[0], model[2]))
        assert torch.allclose(model(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 37), (2, 8)])
def test_rms_norm_matches_reference(isas, shape, dtype):
    g = torch.Generator().manual_seed(shape[1])
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[1], generator=g)).to(dtype)
    ref = rms_norm_forward(x, w, 1e-6).float()
    rel = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    for isa in isas:
        ce.configure(isa=isa)
        y = rms_norm(x, w, 1e-6)
        assert y.dtype == dtype and y.shape == x.shape
        assert bool(((y.float() - ref).abs() <= rel * ref.abs() + 1e-6).all())


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "L%s_h%d_kv%d_d%d_w%s" % (
    "-".join(map(str, c[0])), *c[1:]))
def test_decode_attention_matches_reference(isas, case, dtype, qk_norm):
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, qk_norm)
    scale = d ** -0.5
    ref_k, ref_v = args[9].clone(), args[10].clone()
    want = decode_attention_forward(*args[:9], ref_k, ref_v, *args[11:], window, scale)
    ref32 = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, scale)
    for isa in isas:
        ce.configure(isa=isa)
        k_cache, v_cache = args[9].clone(), args[10].clone()
        got = ca.decode_attention(*args[:9], k_cache, v_cache, *args[11:], window, scale)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(v_cache, ref_v)
        assert (k_cache.float() - ref_k.float()).abs().max() <= (0 if dtype == torch.float32 else 2.0 ** -7) \
            * ref_k.float().abs().max() + 1e-6
        scale_ref = ref32.abs().max()
        tol = 1e-5 * scale_ref + 1e-6 if dtype == torch.float32 else 2.0 ** -7 * scale_ref
        assert (got.float() - ref32).abs().max() <= tol, isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,rot", PARTIAL, ids=lambda c: str(c))
def test_a_partial_rotary_matches_reference(isas, case, rot, dtype):
    """The rotary over the first ``rot`` dimensions of each head only (GLM-4.5, MiniMax-M2): the
    rest of each q and k head passes unrotated, and the keys written say so."""
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, True, rot=rot)
    ref_k, ref32 = references(args, window, d ** -0.5)
    for isa in isas:
        ce.configure(isa=isa)
        k_cache = args[9].clone()
        got = ca.decode_attention(*args[:9], k_cache, args[10].clone(), *args[11:], window, d ** -0.5)
        slot = args[11]
        rel = 0 if dtype == torch.float32 else 2.0 ** -7
        assert (k_cache[slot].float() - ref_k[slot].float()).abs().max() <= rel * ref_k.float().abs().max() + 1e-6
        tol = (1e-5 if dtype == torch.float32 else 2.0 ** -7) * ref32.abs().max() + 1e-6
        assert (got.float() - ref32).abs().max() <= tol, isa


def test_multi_sequence_batch_is_independent_of_threads(isas):
    args = attention_problem((17, 3, 9), 8, 2, 64, torch.float32, True)
    outs = []
    for threads in (1, 2):
        ce.configure(threads=threads)
        outs.append(ca.decode_attention(*args[:9], args[9].clone(), args[10].clone(), *args[11:], None, 0.125))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("case", [((19,), 12, 4, 24, None), ((19, 7), 12, 4, 24, None), ((33,), 16, 1, 72, 9)],
                         ids=["one_row_gqa", "two_rows_gqa", "one_row_one_kv_head"])
def test_query_heads_split_among_threads_give_the_same_bits(isas, case):
    """Fewer rows than threads: each row's query heads are split among the threads (3 and 5
    threads cut a KV head's group of 3 heads in two), the K/V written first. Every thread count
    gives the same bits and the reference's output."""
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, torch.float32, True)
    ref_k, ref32 = references(args, window, d ** -0.5)
    outs = []
    for threads in (1, 2, 3, 5):
        ce.configure(threads=threads)
        k_cache = args[9].clone()
        outs.append(ca.decode_attention(*args[:9], k_cache, args[10].clone(), *args[11:], window, d ** -0.5))
        assert (k_cache - ref_k).abs().max() <= 1e-6
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert (outs[0] - ref32).abs().max() <= 1e-5 * ref32.abs().max() + 1e-6


def test_values_that_are_the_keys_read_the_rotated_keys_latent_parts(isas):
    """A latent attention's pool (cache/kv.py ``shared_values``): one tensor as K and V, each new
    token's value row its unrotated key row. The kernel leaves the rotated key in the slot, and
    every head's output past the rotated dimensions is what separate caches holding the same
    rows give."""
    rot, h, d = 8, 16, 40
    args = attention_problem((21, 5), h, 1, d, torch.float32, False, rot=rot)
    qkv = args[0].view(2, h + 2, d)
    qkv[:, h + 1] = qkv[:, h]                                  # the value row is the key row
    keys = args[9]
    ref_k, _ = references(args, None, 0.1)
    apart = ca.decode_attention(*args[:9], keys.clone(), keys.clone(), *args[11:], None, 0.1)
    for threads in (1, 2):
        ce.configure(threads=threads)
        pool = keys.clone()
        got = ca.decode_attention(*args[:9], pool, pool, *args[11:], None, 0.1)
        assert (pool - ref_k).abs().max() <= 1e-6
        assert torch.equal(got.view(2, h, d)[..., rot:], apart.view(2, h, d)[..., rot:])


@pytest.mark.parametrize("model_type", ["glm4_moe", "minimax_m2", "olmoe", "qwen3_next", "hunyuan_v1_moe"])
def test_partial_rotary_and_whole_projection_norms_decode_through_the_fused_kernel(tiny_checkpoint, monkeypatch,
                                                                                  model_type):
    """GLM's half-head rotary, MiniMax-M2's (with q/k norms over the whole projection, applied
    before the kernel), OLMoE's whole-projection norms, Qwen3-Next's quarter-head rotary,
    Hunyuan's norms after the rotary (both before the kernel, which rotates by the identity):
    their decode steps run the compiled kernel, and give the tokens of the unfused path they took
    before. (The layers' own modules: a fused layer, executor/cpu_decode.py, calls the kernel from C.)"""
    from freetoken_engine import LLM, SamplingParams
    from freetoken_engine.layers.attention import Attention
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompt = [5, 17, 99, 200, 3, 44, 12, 300]
    folder = tiny_checkpoint(model_type)
    calls = []
    fused = ca.decode_attention
    monkeypatch.setattr(ca, "decode_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    got = LLM(folder, fused_cpu_decode=False).generate(prompt, greedy).token_ids
    assert calls
    monkeypatch.setattr(Attention, "_decode_kernel", lambda self, x, k_cache: None)
    calls.clear()
    assert LLM(folder, fused_cpu_decode=False).generate(prompt, greedy).token_ids == got and not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [c for c in CASES if c[1] % c[2] == 0][:4], ids=lambda c: "L%s_h%d_kv%d_d%d_w%s" % (
    "-".join(map(str, c[0])), *c[1:]))
def test_attention_sinks_join_each_softmax_as_the_reference_has_them(isas, case, dtype):
    """A sink per query head (Granite swash, gpt-oss), large enough to take most of the weight
    from some heads and little from others: the kernel's output is the reference's."""
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, False)
    sinks = torch.linspace(-3.0, 6.0, h).to(dtype)
    plain = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, d ** -0.5)
    ref32 = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, d ** -0.5, sinks)
    assert (plain - ref32).abs().max() > 0.1 * plain.abs().max()          # the sinks change the answer
    for isa in isas:
        ce.configure(isa=isa)
        got = ca.decode_attention(*args[:9], args[9].clone(), args[10].clone(), *args[11:], window, d ** -0.5,
                                  sinks=sinks)
        tol = 1e-5 * ref32.abs().max() + 1e-6 if dtype == torch.float32 else 2.0 ** -7 * ref32.abs().max()
        assert (got.float() - ref32).abs().max() <= tol, isa


@pytest.mark.parametrize("chunk,window", [(8, None), (5, 3), (64, None)])
def test_attention_chunks_leave_the_earlier_chunks_keys_out(isas, chunk, window):
    """Llama 4's chunked layers: a token attends to the keys of its own chunk only (17, 3 and 9
    keys: the 17th token's chunk of 8 starts at 16; with a window too, the later bound wins)."""
    args = attention_problem((17, 3, 9), 16, 4, 128, torch.float32, False)
    plain = decode_attention_forward(*args[:9], args[9].clone(), args[10].clone(), *args[11:], window, 0.1)
    want = decode_attention_forward(*args[:9], args[9].clone(), args[10].clone(), *args[11:], window, 0.1, chunk=chunk)
    assert (chunk >= 17) == torch.equal(plain, want)            # a chunk past every length changes nothing
    for isa in isas:
        ce.configure(isa=isa)
        got = ca.decode_attention(*args[:9], args[9].clone(), args[10].clone(), *args[11:], window, 0.1, chunk=chunk)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6, isa
