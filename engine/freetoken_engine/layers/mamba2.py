"""Mamba-2: the state-space token mixer of IBM Granite 4.0's hybrids (``granitemoehybrid``).

``in_proj`` gives, per token, a gate z (the intermediate size I), the inputs x, B and C (I, then
``n_groups`` x N each: one B and C per group of heads) and a time step per head. x, B and C pass a
causal depthwise convolution of width K (with its bias, then SiLU). Per head (P = I / heads
dimensions) the layer keeps an ``[N, P]`` float32 state S and, per token t::

    dt = softplus(dt_t + dt_bias) (within time_step_limit);   a = exp(-exp(A_log) dt)
    S <- a S + dt B_t x_t^T;                                  y_t = S^T C_t + D x_t

then RMS-normalises y * SiLU(z) over each group of I / n_groups channels, scales it and projects
it (``out_proj``). A sequence's state lives in a slot of the ``StatePool`` under the Gated
DeltaNet's contract (``layers/deltanet.py``: ``LinearAttnConfig`` with ``k_heads`` the groups,
``k_dim`` N, ``v_heads`` the heads, ``v_dim`` P; the convolution's last K - 1 inputs beside it).
A prompt's chunk runs the chunked form below, one token per sequence the recurrence for the
whole batch at once; a few tokens on the CPU (a draft's verification) take the recurrence.

The chunked form, for a chunk of C tokens entering with state S0 (l = dt A per token, L its
running sum in the chunk, W[t, j] = exp(L_t - L_j) for j <= t, else 0):
    Y = (W * C B^T) (dt x) + exp(L) (C S0) + D x,    S_C = exp(L_C) S0 + (B exp(L_C - L))^T (dt x)
It runs on torch's ops everywhere; chained decode rows run on the CPU only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LinearAttnConfig
from .deltanet import STEPS, depthwise_conv, each_sequence, in_segments, keep_states, take_states
from .linear import linear

CHUNK = 64


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: ``x [B, h, P]``, ``dt [B, h]``, ``a [h]`` (negative),
    ``b``/``c [B, h, N]``, ``state [B, h, N, P]`` (float32) -> (``y [B, h, P]`` without D x, the
    new state)."""
    state = state * (dt * a).exp()[..., None, None] + (dt[..., None] * b)[..., :, None] * x[..., None, :]
    return torch.einsum("bhn,bhnp->bhp", c, state), state


def ssd_steps(x, dt, a, b, c, state):
    """``ssd_chunked``'s contract token by token with ``ssd_step`` (decode's arithmetic)."""
    outs, state = [], state[None]
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], state)
        outs.append(y)
    return torch.cat(outs), state[0]


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence: ``x [n, h, P]``, ``dt [n, h]``, ``a [h]``, ``b``/``c [n, h, N]``,
    ``state [h, N, P]`` (float32) -> (``y [n, h, P]`` without D x, the state after them). Inside
    the chunks everything is computed at once; the state passes from chunk to chunk in a loop.
    The last chunk is padded with tokens that change nothing (dt = 0, x = b = c = 0)."""
    n, h = x.shape[:2]
    pad = -n % chunk
    if pad:
        x, b, c = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (x, b, c))
        dt = F.pad(dt, (0, 0, 0, pad))
    xd = (x * dt[..., None]).view(-1, chunk, h, x.shape[-1]).permute(2, 0, 1, 3)           # [h, Nc, C, P]
    bc, cc = (z.view(-1, chunk, h, z.shape[-1]).permute(2, 0, 1, 3) for z in (b, c))        # [h, Nc, C, N]
    cum = (dt * a).view(-1, chunk, h).permute(2, 0, 1).cumsum(-1)                           # L [h, Nc, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    w = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # [h, Nc, C, C]
    y = (w * (cc @ bc.transpose(-1, -2))) @ xd                                               # [h, Nc, C, P]
    last = cum[..., -1:]                                                                     # L_C [h, Nc, 1]
    gain = (bc * (last - cum).exp()[..., None]).transpose(-1, -2) @ xd                       # [h, Nc, N, P]
    grow, carry = cum.exp()[..., None], last.exp()[..., None]
    for k in range(xd.shape[1]):
        y[:, k] += grow[:, k] * (cc[:, k] @ state)
        state = carry[:, k] * state + gain[:, k]
    return y.permute(1, 2, 0, 3).reshape(-1, h, x.shape[-1])[:n], state


class Mamba2(nn.Module):
    """Checkpoint names as Granite 4.0 writes them (``mamba.in_proj``, ``conv1d``, ``dt_bias``,
    ``A_log``, ``D``, ``norm.weight``, ``out_proj``; the family maps ``mamba.`` to the engine's
    ``linear_attn.``)."""

    def __init__(self, hidden: int, lin: LinearAttnConfig, state_index: int, eps: float):
        super().__init__()
        self.lin, self.state_index, self.eps = lin, state_index, eps
        self.inner = lin.v_heads * lin.v_dim
        self.sizes = (self.inner, lin.conv_dim, lin.v_heads)                                 # z, xBC, dt
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=lin.proj_bias)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv, groups=lin.conv_dim, bias=lin.bias)
        self.dt_bias = nn.Parameter(torch.ones(lin.v_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.v_heads))
        self.D = nn.Parameter(torch.ones(lin.v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, hidden, bias=lin.proj_bias)
        self.conv_w: torch.Tensor | None = None
        self.states = None                     # the StatePool, attached by the runner

    def fuse(self) -> None:
        with torch.no_grad():
            self.conv_w = self.conv1d.weight[:, 0, :].contiguous()                           # [C, K]
            self.a = -self.A_log.float().exp()

    def chains(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Chained decode rows (``AttnBatch.state_chain``) run eagerly on the CPU only."""
        return device.type != "cuda"

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        lin, pool = self.lin, self.states
        conv, ssm = pool.conv[self.state_index], pool.ssm[self.state_index]
        z, xbc, dt = linear(x, self.in_proj.weight, self.in_proj.bias).split(self.sizes, -1)
        lo, hi = lin.dt_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(lo, hi)
        core = x.new_empty((x.shape[0], lin.v_heads, lin.v_dim))
        each_sequence(
            batch, x.device, core, "chained decode rows need the CPU in a Mamba-2 model",
            chunk=lambda i, at, n: self._chunk(xbc[at:at + n], dt[at:at + n], batch.state_slots[i], batch.fresh(i),
                                               batch.snaps(i), conv, ssm),
            singles=lambda rows, slots, seqs, out_slots=None: self._singles(rows, slots, seqs, xbc, dt, batch, conv,
                                                                          ssm, core, out_slots))
        out = self._gated_norm(core.reshape(x.shape[0], self.inner), z)
        return linear(out, self.out_proj.weight, self.out_proj.bias)

    def _conv(self, seq: torch.Tensor) -> torch.Tensor:
        """``seq [B, n + K - 1, C]`` (the K - 1 inputs before, then n new ones) -> SiLU of the
        convolution, ``[B, n, C]``."""
        w = self.conv_w if self.conv_w is not None else self.conv1d.weight[:, 0, :]
        return F.silu(depthwise_conv(seq, w, self.conv1d.bias))

    def _split(self, y: torch.Tensor):
        """The convolved ``y [n, C]`` -> x ``[n, h, P]``, B and C ``[n, h, N]`` (each group's for
        its heads), float32."""
        lin = self.lin
        gn = lin.k_heads * lin.k_dim
        xs, b, c = y.float().split((self.inner, gn, gn), -1)
        rep = lin.v_heads // lin.k_heads
        b, c = (z.view(-1, lin.k_heads, lin.k_dim).repeat_interleave(rep, 1) for z in (b, c))
        return xs.view(-1, lin.v_heads, lin.v_dim), b, c

    def _chunk(self, xbc, dt, slot: int, fresh: bool, snaps, conv, ssm) -> torch.Tensor:
        """A prompt's chunk of one sequence; ``snaps``: (offset in the chunk, checkpoint slot) to
        copy the state after."""
        past = conv[slot].zero_() if fresh else conv[slot]
        state = ssm[slot].zero_() if fresh else ssm[slot]
        seq = torch.cat((past.to(xbc.dtype), xbc))                       # the raw inputs, for the conv states
        xs, b, c = self._split(self._conv(seq[None])[0])
        width = self.conv_w.shape[1] - 1

        def run(at: int, end: int, state: torch.Tensor):
            steps = end - at <= STEPS and xbc.device.type == "cpu"
            return (ssd_steps if steps else ssd_chunked)(xs[at:end], dt[at:end], self.a, b[at:end], c[at:end], state)
        y = in_segments(xbc.shape[0], snaps, run, state, ssm, conv, seq, slot, width)
        return (y + self.D.float()[:, None] * xs).to(xbc.dtype)

    def _singles(self, rows, slots, seqs, xbc, dt, batch, conv, ssm, core, out_slots=None) -> None:
        """One token of each of several sequences, together (``GatedDeltaNet._singles``' contract)."""
        past, state = take_states(conv, ssm, slots, seqs, batch)
        m = xbc if rows is None else xbc.index_select(0, rows)                   # [B, C]
        if rows is not None:
            dt = dt.index_select(0, rows)
        seq = torch.cat((past.to(m.dtype), m[:, None]), 1)                      # [B, K, C]
        xs, b, c = self._split(self._conv(seq)[:, 0])
        y, state = ssd_step(xs, dt, self.a, b, c, state)
        y = (y + self.D.float()[:, None] * xs).to(core.dtype)
        if rows is None:
            core.copy_(y)
        else:
            core.index_copy_(0, rows, y)
        keep_states(ssm, conv, slots, out_slots, state, seq, seqs, batch)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y * SiLU(z)`` RMS-normed over each group of I / n_groups channels (float32), then
        scaled, in the model's dtype."""
        dtype, groups = y.dtype, self.lin.k_heads
        g = (y.float() * F.silu(z.float())).view(y.shape[0], groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm.weight * g.view(y.shape[0], -1).to(dtype)
