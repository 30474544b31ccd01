"""The GPU decode layer kernels against their references: attention (kernels/triton/attention.py),
RMSNorm (norm.py) and the router's selection (route.py). On CPU under
TRITON_INTERPRET=1 (CI) and compiled on a GPU (``TRITON_INTERPRET=0 pytest`` this file there):
attention: K/V written where the reference writes them, the output within fp32 1e-5 / bf16 and
fp16 2^-7 of the largest output (the reference computed in fp32). Triton's interpreter truncates
fp32 -> bf16 instead of rounding to nearest, so under it 16-bit types may be off by one more ulp:
2^-6 there."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from attention_cases import CASES, PARTIAL, attention_problem, references  # noqa: E402
from freetoken_engine.kernels.reference import decode_attention_forward  # noqa: E402
from freetoken_engine.kernels.triton import attention as ta  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"
REL16 = 2.0 ** -7 if COMPILED else 2.0 ** -6

TRITON_CASES = [c for c in CASES if c[3] >= 16] + [
    ((130, 1, 64), 32, 4, 128, None),      # Qwen3-30B's heads; keys across several blocks of 64
    ((100, 7), 8, 2, 64, 40),              # a window that starts inside a block
    ((700, 3), 4, 2, 32, None),            # three chunks of 256 keys, merged
    ((600, 2), 4, 1, 32, 300),             # a window across a chunk boundary
    ((70, 5), 16, 1, 72, None),            # a latent attention's shape: one KV head, not a power of two
]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "L%s_h%d_kv%d_d%d_w%s" % (
    "-".join(map(str, c[0])), *c[1:]))
def test_decode_attention_matches_reference(case, dtype, qk_norm):
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, qk_norm)
    scale = d ** -0.5
    ref_k, ref_v = args[9].clone(), args[10].clone()
    decode_attention_forward(*args[:9], ref_k, ref_v, *args[11:], window, scale)
    ref32 = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, scale)
    dev = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    assert ta.supported(dev[0], dev[9], d)
    got = ta.decode_attention(*dev, window, scale).cpu()
    assert got.dtype == dtype and got.shape == ref32.shape
    assert torch.equal(dev[10].cpu(), ref_v)
    assert (dev[9].cpu().float() - ref_k.float()).abs().max() <= (1e-6 if dtype == torch.float32 else REL16) \
        * ref_k.float().abs().max() + 1e-6
    top = ref32.abs().max()
    tol = 1e-5 * top + 1e-6 if dtype == torch.float32 else REL16 * top
    assert (got.float() - ref32).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case,rot", PARTIAL + [(((70, 5), 16, 1, 72, None), 8)], ids=lambda c: str(c))
def test_a_partial_rotary_matches_reference(case, rot, dtype):
    """The rotary over the first ``rot`` dimensions of each head only (GLM-4.5, MiniMax-M2)."""
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, True, rot=rot)
    ref_k, ref32 = references(args, window, d ** -0.5)
    dev = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    got = ta.decode_attention(*dev, window, d ** -0.5).cpu()
    rel = 1e-6 if dtype == torch.float32 else REL16
    assert (dev[9].cpu().float() - ref_k.float()).abs().max() <= rel * ref_k.float().abs().max() + 1e-6
    tol = (1e-5 if dtype == torch.float32 else REL16) * ref32.abs().max() + 1e-6
    assert (got.float() - ref32).abs().max() <= tol


def test_values_that_are_the_keys_keep_the_rotated_key():
    """A latent attention's pool (cache/kv.py ``shared_values``): one tensor as K and V, each new
    token's value row its unrotated key row; the slot keeps the rotated key and every head's
    output past the rotated dimensions is what separate caches holding the same rows give."""
    rot, h, d = 8, 16, 40
    args = attention_problem((21, 5), h, 1, d, torch.float32, False, rot=rot)
    qkv = args[0].view(2, h + 2, d)
    qkv[:, h + 1] = qkv[:, h]
    ref_k, _ = references(args, None, 0.1)
    dev = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    keys = dev[9]
    apart = ta.decode_attention(*dev[:9], keys.clone(), keys.clone(), *dev[11:], None, 0.1).cpu()
    pool = keys.clone()
    got = ta.decode_attention(*dev[:9], pool, pool, *dev[11:], None, 0.1).cpu()
    assert (pool.cpu() - ref_k).abs().max() <= 1e-6
    assert (got.view(2, h, d)[..., rot:] - apart.view(2, h, d)[..., rot:]).abs().max() <= 1e-6


def test_small_heads_and_other_layouts_are_left_to_torch():
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not ta.supported(x, torch.zeros(4, 2, 8, dtype=torch.bfloat16), 8)        # head dim below 16
    assert not ta.supported(x, torch.zeros(4, 1, 2048, dtype=torch.bfloat16), 2048)  # past 1024
    assert not ta.supported(x, torch.zeros(4, 1, 45, dtype=torch.bfloat16), 45)      # odd
    assert ta.supported(x, torch.zeros(4, 1, 576, dtype=torch.bfloat16), 576)        # DeepSeek's latent, masked
    assert not ta.supported(x, torch.zeros(4, 2, 64), 64)                            # pool in another dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 37), (4, 8, 128)])
def test_rms_norm_matches_reference(shape, dtype):
    from freetoken_engine.kernels.reference import rms_norm_forward
    from freetoken_engine.kernels.triton.norm import rms_norm, supported
    g = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    ref = rms_norm_forward(x, w, 1e-6).float()
    assert supported(x.to(DEVICE), w.to(DEVICE))
    y = rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    assert y.dtype == dtype and y.shape == x.shape
    rel = 1e-6 if dtype == torch.float32 else REL16
    assert bool(((y.float() - ref).abs() <= rel * ref.abs() + 1e-6).all())


def _torch_route(logits, k, softmax, norm, dtype):
    """layers/moe.py's torch path (the reference)."""
    if not softmax:
        ids = torch.topk(logits, k, dim=-1).indices
        return torch.ones(ids.shape, dtype=dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(dtype), ids


@pytest.mark.parametrize("softmax,norm", [(True, True), (True, False), (False, False)],
                         ids=["softmax-norm", "softmax", "unit"])
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (4, 256, 8), (3, 60, 4), (2, 8, 8)])
def test_route_picks_the_reference_experts_and_weights(t, e, k, softmax, norm):
    from freetoken_engine.kernels.triton.route import route, supported
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(e + k)).to(torch.bfloat16)
    want_w, want_ids = _torch_route(logits, k, softmax, norm, torch.bfloat16)
    assert supported(logits.to(DEVICE), k)
    w, ids = route(logits.to(DEVICE), k, softmax, norm, torch.bfloat16)
    ids = ids.cpu()
    # a top-k: the chosen experts' logits are the k largest, best first (bf16 logits tie often;
    # among equal ones torch's order is unspecified, this kernel takes the lower index)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids)), (ids, want_ids)
    assert all(len(set(row)) == k for row in ids.tolist())
    distinct = (logits.gather(1, want_ids)[:, :, None] != logits[:, None, :]).sum(-1) == e - 1
    assert torch.equal(ids[distinct], want_ids[distinct])
    assert w.dtype == torch.bfloat16 and (w.cpu().float() - want_w.float()).abs().max() <= REL16


def test_route_breaks_ties_toward_the_lower_expert():
    from freetoken_engine.kernels.triton.route import route
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 1.0]])
    w, ids = route(logits.to(DEVICE), 4, True, True, torch.float32)
    assert ids.cpu().tolist() == [[1, 3, 2, 4]]
    assert abs(float(w.sum()) - 1.0) < 1e-6 and float(w[0, 0]) == float(w[0, 1])


@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "unit"])
def test_route_of_nan_or_infinite_logits_stays_inside_the_experts(softmax):
    """A NaN hidden state (fp16 overflow, a broken checkpoint) must not route to an expert that
    does not exist: the ids index the cache's residency table and the bank. Rows: all NaN, NaN
    among numbers, all -inf, +inf among numbers."""
    from freetoken_engine.kernels.triton.route import route
    e, k = 128, 8
    logits = torch.randn(4, e, generator=torch.Generator().manual_seed(3))
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")
    _, ids = route(logits.to(DEVICE), k, softmax, softmax, torch.float32)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < e)).all(), ids
    assert all(len(set(row)) == k for row in ids.tolist()), ids
    if softmax:     # one NaN or +inf makes the whole softmax NaN (as torch's): the lowest ids
        assert ids[1].tolist() == ids[3].tolist() == list(range(k))
    else:           # the scores themselves: NaN ranks last, +inf first
        finite = logits[1].nan_to_num(nan=float("-inf"))
        assert sorted(ids[1].tolist()) == sorted(finite.topk(k).indices.tolist())
        assert ids[3, 0] == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", TRITON_CASES[-4:], ids=lambda c: "L%s_h%d_kv%d_d%d_w%s" % (
    "-".join(map(str, c[0])), *c[1:]))
def test_attention_sinks_join_the_merged_softmax(case, dtype):
    """A sink per query head, added once in the merge of the chunks' partial softmaxes (several
    chunks of 256 keys here, and a window across them)."""
    lens, h, kvh, d, window = case
    args = attention_problem(lens, h, kvh, d, dtype, False)
    sinks = torch.linspace(-3.0, 6.0, h).to(dtype)
    ref32 = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, d ** -0.5, sinks)
    dev = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    got = ta.decode_attention(*dev, window, d ** -0.5, sinks=sinks.to(DEVICE)).cpu()
    tol = 1e-5 * ref32.abs().max() + 1e-6 if dtype == torch.float32 else REL16 * ref32.abs().max()
    assert (got.float() - ref32).abs().max() <= tol


@pytest.mark.parametrize("chunk,window", [(256, None), (100, 40), (8192, None)])
def test_attention_chunks_start_each_token_at_its_chunk(chunk, window):
    """Llama 4's chunked layers through the split-K kernel: 700 keys in chunks of 256 (the keys
    of programs below the token's chunk left out entirely), with a window, and one chunk for all."""
    args = attention_problem((700, 3), 4, 2, 32, torch.float32, False)
    ref = decode_attention_forward(*args, window, 0.2, chunk=chunk)
    dev = [a.to(DEVICE) if torch.is_tensor(a) else a for a in args]
    got = ta.decode_attention(*dev, window, 0.2, chunk=chunk).cpu()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6
