"""Decode-attention problems shared by the CPU kernel's and the Triton kernel's tests: B new
tokens (one per sequence) over a paged KV pool whose blocks are scattered and never shared."""
from __future__ import annotations

import torch

CASES = [  # lens per sequence, heads, kv heads, head_dim, window
    ((5,), 4, 2, 8, None),
    ((1,), 2, 2, 16, None),
    ((17, 3, 9), 16, 4, 128, None),
    ((23, 2), 8, 1, 64, 6),
]
# rotary over part of each head (GLM-4.5's half, MiniMax-M2's quarter): (case, rotary dims)
PARTIAL = [(((17, 3, 9), 16, 4, 128, None), 64), (((23, 2), 8, 1, 64, 6), 16)]


def attention_problem(lens, h, kvh, d, dtype, qk_norm, seed=0, rot=None):
    """The argument list of ``decode_attention`` (reference.decode_attention_forward's order)
    without ``window`` and ``scale``: sequences of ``lens`` keys, the last one new; ``rot``: the
    rotary over the first ``rot`` dimensions of each head only (None: all)."""
    g = torch.Generator().manual_seed(seed)
    b, block = len(lens), 4
    per = max(6, -(-max(lens) // block))                        # blocks each sequence may use
    slots = 4 * b * per * block
    qkv = torch.randn(b, (h + 2 * kvh) * d, generator=g).to(dtype)
    k_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, kvh, d, generator=g).to(dtype)
    lmax = max(lens)
    perm = torch.randperm(slots // block, generator=g)         # scattered blocks, none shared
    kv_index = torch.zeros(b, lmax, dtype=torch.int64)
    for i, n in enumerate(lens):
        p = torch.arange(n)
        kv_index[i, :n] = perm[i * per + p // block] * block + p % block
    slot = kv_index[torch.arange(b), torch.tensor(lens) - 1].clone()
    ang = torch.rand(b, 1, (rot or d) // 2, generator=g) * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to(dtype)
    norms = ((1 + 0.1 * torch.randn(d, generator=g)).to(dtype), (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)) \
        if qk_norm else (None, None)
    return [qkv, h, kvh, d, *norms, 1e-6, cos, sin, k_cache, v_cache, slot, kv_index,
            torch.tensor(lens, dtype=torch.int64)]


def references(args, window, scale):
    """(the K cache the reference writes, its output computed in fp32) of ``attention_problem``'s
    ``args``, which stay as they were."""
    from freetoken_engine.kernels.reference import decode_attention_forward
    ref_k = args[9].clone()
    decode_attention_forward(*args[:9], ref_k, args[10].clone(), *args[11:], window, scale)
    ref32 = decode_attention_forward(*[a.float() if torch.is_tensor(a) and a.is_floating_point() else a
                                       for a in args], window, scale)
    return ref_k, ref32
