"""Kimi Delta Attention (Kimi-Linear): Gated DeltaNet (``layers/deltanet.py``) whose decay is one
per key channel instead of one per head.

Per head the layer keeps a ``[d, d]`` float32 state S and, per token t::

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q, k and v each from a projection and a causal depthwise convolution (then SiLU), q and k
l2-normalised (q also scaled by d^-1/2), beta = sigmoid(b_proj x), and the decay from a low-rank
forget gate, g = -exp(A_log) softplus(f_b(f_a x) + dt_bias), a value per head and channel. The
output of each head is RMS-normed (float32, by ``o_norm``), gated by sigmoid(g_b(g_a x)), and
projected. Every head has its own keys and values (no grouping).

The chunked form keeps the decays per channel: for tokens t >= j of a chunk,
D[t, j, c] = exp(G_t,c - G_j,c) (G the cumulative g), never above one, held for a chunk at a
time; then, as Gated DeltaNet's (the same hand-over of the state between chunks),
    (I + A) U = beta v - beta (exp(G) * K) S0,   A[t, j] = beta_t sum_c k_t,c k_j,c D[t, j, c]  (j < t)
    O = (exp(G) * Q) S0 + P U,                   P[t, j] = sum_c q_t,c k_j,c D[t, j, c]        (j <= t)
    S_C = diag(exp(G_C)) S0 + (K * exp(G_C - G))^T U
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LinearAttnConfig
from .deltanet import CHUNK, GatedDeltaNet, _hand_over
from .linear import linear

#: bytes of per-channel decays held at once by the chunked form (a chunk's sub-blocks at least)
DECAY_BYTES = 64 << 20
SUB = 4             # tokens of a sub-block, inside which the decays are held whole


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence: ``q``/``k``/``g [n, h, dk]``, ``v [n, h, dv]``, ``beta [n, h]``,
    ``state [h, dk, dv]`` (float32) -> (``o [n, h, dv]``, the state after them); the last chunk
    padded with tokens that change nothing. ``kernel``: unused (no GPU hand-over kernel takes
    per-channel decays)."""
    n, h, dk = q.shape
    pad = -n % chunk
    if pad:
        q, k, v, g = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    qc, kc, vc, gc = (z.view(-1, chunk, h, z.shape[-1]).permute(2, 0, 1, 3) for z in (q, k, v, g))   # [h, N, C, d]
    bc = beta.view(-1, chunk, h).permute(2, 0, 1)                                                      # [h, N, C]
    cum = gc.cumsum(2)
    kk, qk = _decayed_products(qc, kc, cum)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = causal & ~torch.eye(chunk, dtype=torch.bool, device=q.device)
    system = (bc[..., None] * kk).masked_fill(~strict, 0.0) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    grow = cum.exp()
    rhs = torch.cat((bc[..., None] * vc, bc[..., None] * grow * kc), -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    ub, w = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
    last = cum[..., -1:, :]                                                   # G_C [h, N, 1, dk]
    ke = kc * (last - cum).exp()
    out, state = _hand_over(ub, w, grow * qc, qk, ke.transpose(-1, -2), last.exp().transpose(-1, -2), state)
    return out.permute(1, 2, 0, 3).reshape(-1, h, vc.shape[-1])[:n], state


def _decayed_products(qc: torch.Tensor, kc: torch.Tensor, cum: torch.Tensor, sub: int = SUB):
    """``k_t . (k_j * D[t, j])`` and ``q_t . (k_j * D[t, j])`` of each chunk (``[h, N, C, C]``, zero
    where j > t; D[t, j, c] = exp(G_t,c - G_j,c)). Within a sub-block of ``sub`` tokens the decays
    are held whole; between sub-blocks b < a the decay splits at b's last token G_e into two
    factors of at most one, exp(G_t - G_e) exp(G_e - G_j), so the block is a product of two
    [sub, d] matrices (a single reference for the whole chunk would overflow exp once a chunk's
    decays sum past about -88)."""
    h, nc, c, d = kc.shape
    nb = c // sub
    qs, ks, gs = (z.view(h, nc, nb, sub, d) for z in (qc, kc, cum))
    kk, qk = (qc.new_zeros((h, nc, nb, sub, nb, sub)) for _ in range(2))
    lower = torch.ones(sub, sub, dtype=torch.bool, device=qc.device).tril()
    step = max(1, DECAY_BYTES // (h * nb * sub * sub * d * 4))
    for s in range(0, nc, step):
        g = gs[:, s:s + step]
        decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(~lower[..., None], float("-inf")).exp()
        kj = ks[:, s:s + step, :, None, :, :] * decay                          # [h, m, nb, S, S, d]
        for z, out in ((ks, kk), (qs, qk)):
            out[:, s:s + step].diagonal(dim1=2, dim2=4).copy_(
                (z[:, s:s + step, :, :, None, :] * kj).sum(-1).permute(0, 1, 3, 4, 2))
    for b in range(nb - 1):
        end = gs[:, :, b, -1:, :]                                               # G_e [h, N, 1, d]
        right = (ks[:, :, b] * (end - gs[:, :, b]).exp()).transpose(-1, -2)     # [h, N, d, S]
        scale = (gs[:, :, b + 1:] - end[:, :, None]).exp()                      # [h, N, nb-b-1, S, d]
        for z, out in ((ks, kk), (qs, qk)):
            out[:, :, b + 1:, :, b, :] = (z[:, :, b + 1:] * scale) @ right[:, :, None]
    return kk.view(h, nc, c, c), qk.view(h, nc, c, c)


class KimiDeltaAttention(GatedDeltaNet):
    """Checkpoint names as Kimi-Linear publishes them (``self_attn.q_proj``, ``q_conv1d``,
    ``f_a_proj``, ``A_log [1, 1, h, 1]``, ...: ``models/kimi_linear.py`` maps them); ``fuse()``
    joins the first projections (q, k, v, b, f_a, g_a) into one and the three convolutions."""
    chunked = staticmethod(kda_chunked)

    def __init__(self, hidden: int, lin: LinearAttnConfig, state_index: int, eps: float):
        nn.Module.__init__(self)
        self.lin, self.state_index, self.eps = lin, state_index, eps
        h, d = lin.v_heads, lin.v_dim
        self.sizes = (3 * h * d, h, d, d)                                      # q k v, b, f_a, g_a
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, nn.Linear(hidden, h * d, bias=False))
            setattr(self, name[0] + "_conv1d", nn.Conv1d(h * d, h * d, lin.conv, groups=h * d, bias=False))
        self.b_proj = nn.Linear(hidden, h, bias=False)
        self.f_a_proj, self.f_b_proj = nn.Linear(hidden, d, bias=False), nn.Linear(d, h * d, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(hidden, d, bias=False), nn.Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h * d))
        self.A_log = nn.Parameter(torch.zeros(h))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(d))
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.proj: torch.Tensor | None = None
        self.states = None

    def fuse(self) -> None:
        with torch.no_grad():
            self.proj = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.b_proj.weight,
                                   self.f_a_proj.weight, self.g_a_proj.weight])
            self.conv_w = torch.cat([c.weight[:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
            self.neg_a = -self.A_log.float().exp()[:, None]                  # [h, 1]: times each channel's softplus
        del self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_a_proj
        del self.q_conv1d, self.k_conv1d, self.v_conv1d

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        lin, pool = self.lin, self.states
        h, d = lin.v_heads, lin.v_dim
        mixed, b, fa, ga = linear(x, self.proj, None).split(self.sizes, -1)
        conv, ssm = pool.conv[self.state_index], pool.ssm[self.state_index]
        gpu = self._decode_kernels(x, batch)
        if gpu is not None:           # a decode step on a GPU: two launches (kernels/triton/deltanet.py)
            y = gpu.conv_step(mixed, conv, batch.state_index, self.conv_w, chain=batch.state_chain)
            gated = torch.cat((self.g_b_proj(ga), b, self.f_b_proj(fa)), -1)         # gate, b, forget gate
            return self.o_proj(gpu.recurrent_step(y, gated, ssm, batch.state_index, self.neg_a.view(-1), self.dt_bias,
                                                  self.o_norm.weight, lin.k_heads, self.eps, chain=batch.state_chain,
                                                  kda=True))
        beta = b.sigmoid().float()
        g = self.neg_a * F.softplus(self.f_b_proj(fa).float().view(-1, h, d) + self.dt_bias.float().view(h, d))
        core = self._mix(x, batch, mixed, g, beta, conv, ssm)
        out = self._gated_norm(core, self.g_b_proj(ga).view(-1, h, d))
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _chunk_kernel(self, x: torch.Tensor):
        return None                     # the Triton hand-over between chunks takes one decay per head

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each head's output RMS-normed and scaled in float32, times sigmoid(gate), in the model's dtype."""
        normed = o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.o_norm.weight.float() * normed * torch.sigmoid(gate.float())).to(o.dtype)
