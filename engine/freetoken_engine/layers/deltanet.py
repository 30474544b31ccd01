"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3-Next, Qwen3.5/3.6-MoE).

Per value head the layer keeps a ``[k_dim, v_dim]`` float32 state S and, per token t,
decays it, corrects what it predicts for the token's key, and reads it with the query::

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q and k l2-normalised (q also scaled by k_dim^-1/2), beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias). Before that, q, k and v pass a causal depthwise
convolution of width ``conv`` (then SiLU), whose last ``conv - 1`` inputs are the rest of the
state; after it, each head's output is RMS-normed and gated by SiLU(z), then projected.

A sequence's state lives in a slot of the ``StatePool`` (``cache/states.py``) attached after
construction; ``AttnBatch.state_slots`` names each sequence's slot, a sequence whose pass starts
at position 0 starts from zeros, and ``AttnBatch.snapshots`` asks for copies of the state after
given positions (the anchors' checkpoints). A prompt's chunk runs the chunked form below; one
token per sequence runs the recurrence for the whole batch at once.

The chunked form, for a chunk of C tokens entering with state S0 (G = cumulative g in the chunk,
D[t, j] = exp(G_t - G_j) for j <= t, else 0):
    (I + A) U = beta v - beta exp(G) (K S0),  A[t, j] = beta_t D[t, j] k_t.k_j  (j < t)
    O = exp(G) (Q S0) + (D * Q K^T) U,        S_C = exp(G_C) S0 + (K exp(G_C - G))^T U
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LinearAttnConfig
from ..kernels import gpu_decode_kernels
from .linear import linear

CHUNK = 64
#: on the CPU, runs of at most this many tokens (a draft's verification: one token between two
#: snapshots) take the recurrence token by token instead of a chunk padded to CHUNK: a 3-token
#: verification of an 8-layer hybrid had cost 2.7-4x a decode step that way (bench/mtp_speculative.py)
STEPS = 8


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, C]`` after ``past [K-1, C]`` (the inputs before it) through the depthwise causal
    convolution ``weight [C, K]`` and SiLU -> (``[n, C]``, the last K-1 inputs ``[K-1, C]``)."""
    k = weight.shape[1]
    seq = torch.cat((past.to(x.dtype), x))                                 # [n + K-1, C]
    y = F.conv1d(seq.t()[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0].t()
    return F.silu(y).to(x.dtype), seq[seq.shape[0] - (k - 1):]


def depthwise_conv(seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``seq [B, n + K - 1, C]`` (the K - 1 inputs before, then n new ones) through the depthwise
    convolution ``weight [C, K]`` (and ``bias``) -> ``[B, n, C]`` in seq's dtype."""
    y = F.conv1d(seq.transpose(1, 2).to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])
    return y.transpose(1, 2).to(seq.dtype)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: ``q``/``k [B, h, dk]``, ``v [B, h, dv]``, ``g``/``beta
    [B, h]`` (``g [B, h, dk]``: a decay per key channel, Kimi Delta Attention), ``state [B, h, dk,
    dv]`` (float32) -> (``o [B, h, dv]``, the new state)."""
    state = state * (g.exp()[..., None] if g.dim() == q.dim() else g.exp()[..., None, None])
    u = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule_chunked``'s contract, token by token with ``delta_rule_step`` (decode's
    arithmetic): for a few tokens, where a padded chunk costs more than it saves."""
    outs, state = [], state[None]
    for t in range(q.shape[0]):
        o, state = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o)
    return torch.cat(outs), state[0]


def delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence: ``q``/``k [n, h, dk]``, ``v [n, h, dv]``, ``g``/``beta [n, h]``,
    ``state [h, dk, dv]`` (float32) -> (``o [n, h, dv]``, the state after them). Everything inside
    the chunks is computed for all of them at once; only the state's hand-over runs chunk by chunk,
    in one launch with ``kernel`` (``kernels/triton/deltanet_chunk.py``), else a few ops a chunk.
    The last chunk is padded with tokens that change nothing (beta = 0, g = 0, q = k = 0)."""
    n = q.shape[0]
    pad = -n % chunk
    if pad:
        q, k, v = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (q, k, v))
        g, beta = (F.pad(z, (0, 0, 0, pad)) for z in (g, beta))
    h = q.shape[1]
    qc, kc, vc = (z.view(-1, chunk, h, z.shape[-1]).permute(2, 0, 1, 3) for z in (q, k, v))   # [h, N, C, d]
    gc, bc = (z.view(-1, chunk, h).permute(2, 0, 1) for z in (g, beta))                       # [h, N, C]
    cum = gc.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # D [h, N, C, C]
    strict = causal & ~torch.eye(chunk, dtype=torch.bool, device=q.device)
    system = (bc[..., None] * decay * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
    system = system + torch.eye(chunk, dtype=system.dtype, device=q.device)
    grow = cum.exp()[..., None]                                                # exp(G) [h, N, C, 1]
    rhs = torch.cat((bc[..., None] * vc, bc[..., None] * grow * kc), -1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    ub, w = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]            # U = ub - w S0
    attn = decay * (qc @ kc.transpose(-1, -2))
    qg = grow * qc
    last = cum[..., -1:]                                                       # G_C [h, N, 1]
    ke = kc * (last - cum).exp()[..., None]                                    # [h, N, C, dk]
    carry = last.exp()[..., None]                                              # [h, N, 1, 1]
    if kernel is not None:
        out, state = kernel.chunk_states(ub, w, qg, attn, ke, carry[..., 0, 0], state)
    else:
        out, state = _hand_over(ub, w, qg, attn, ke.transpose(-1, -2), carry, state)
    return out.permute(1, 2, 0, 3).reshape(-1, h, vc.shape[-1])[:n], state


def _hand_over(ub, w, qg, attn, kd, carry, state, group: int = 16):
    """The state from chunk to chunk as torch's ops: per chunk only U = UB - W S and the next S
    (three ops, written in place); the outputs O = QG S + A U of ``group`` chunks at a time in two
    batched products, from the states they entered with (kept for the group only)."""
    h, nc, c, dv = ub.shape
    out = torch.empty_like(ub)
    states = state.new_empty((group + 1, *state.shape))         # [g + 1, h, dk, dv]
    us = ub.new_empty((group, h, c, dv))
    states[0] = state
    for g0 in range(0, nc, group):
        m = min(group, nc - g0)
        for j in range(m):
            i = g0 + j
            torch.baddbmm(ub[:, i], w[:, i], states[j], alpha=-1, out=us[j])
            torch.baddbmm(carry[:, i] * states[j], kd[:, i], us[j], out=states[j + 1])
        entered, u = states[:m].transpose(0, 1), us[:m].transpose(0, 1)    # [h, m, ...]
        out[:, g0:g0 + m] = qg[:, g0:g0 + m] @ entered + attn[:, g0:g0 + m] @ u
        states[0] = states[m]
    return out, states[0].clone()


def each_sequence(batch, device: torch.device, out: torch.Tensor, captured_chain: str, chunk, singles) -> None:
    """A pass's rows through a recurrent layer, each sequence from its own state: a prompt's chunk
    (``chunk(i, first row, rows)`` -> its output rows, written to ``out``), the one-token rows
    together (``singles(rows, slots, sequences, out_slots=None)``: rows None for all of them, in
    a captured decode step, which has only ``state_index``), chained rows (a draft's verification)
    in waves, each row from the state the row before it in its chain left (``chain_waves``).
    ``captured_chain``: the error for chained rows in a captured step."""
    if batch.seq_counts is None:          # a captured decode step: a token per sequence, in order
        if batch.state_chain is not None:
            raise RuntimeError(captured_chain)
        singles(None, batch.state_index, ())
        return
    row, ones = 0, []
    for i, n in enumerate(batch.seq_counts):
        if n == 1:
            ones.append((i, row))
        else:
            out[row:row + n] = chunk(i, row, n)
        row += n
    if batch.chain_host is not None and ones:
        for seqs, rows, reads, dsts in chain_waves(ones, batch, device):
            singles(rows, reads, seqs, out_slots=dsts)
    elif len(ones) == len(batch.seq_counts):          # a decode step: every row, slots on the device
        singles(None, batch.state_index, range(len(ones)))
    elif ones:
        singles(torch.tensor([r for _, r in ones], device=device),
                torch.tensor([batch.state_slots[i] for i, _ in ones], device=device), [i for i, _ in ones])


def in_segments(n: int, snaps, run, state: torch.Tensor, ssm: torch.Tensor, conv: torch.Tensor, seq: torch.Tensor,
                slot: int, width: int) -> torch.Tensor:
    """A prompt's chunk of ``n`` tokens of one sequence in segments ending at each checkpoint the
    pass asks for (``snaps``: (offset, checkpoint slot)): ``run(at, end, state) -> (outputs,
    state)`` for each; the state and the last ``width`` convolution inputs (of ``seq``, the K - 1
    before the chunk then its own) copied to each checkpoint after its segment, and to ``slot``
    at the end. Returns the outputs, concatenated."""
    outs, at = [], 0
    for end, ck in list(snaps) + [(n, None)]:
        if end > at:
            out, state = run(at, end, state)
            outs.append(out)
            at = end
        if ck is not None:
            ssm[ck].copy_(state)
            conv[ck].copy_(seq[end:end + width])
    ssm[slot].copy_(state)
    conv[slot].copy_(seq[seq.shape[0] - width:])
    return torch.cat(outs)


def take_states(conv: torch.Tensor, ssm: torch.Tensor, slots: torch.Tensor, seqs, batch):
    """The convolution inputs and states in ``slots`` (copies), zero for the sequences of
    ``seqs`` whose pass starts at position 0."""
    past, state = conv.index_select(0, slots), ssm.index_select(0, slots)
    fresh = [j for j, i in enumerate(seqs) if batch.fresh(i)]
    if fresh:
        past[fresh], state[fresh] = 0, 0
    return past, state


def keep_states(ssm: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor, out_slots: torch.Tensor | None,
                state: torch.Tensor, seq: torch.Tensor, seqs, batch) -> None:
    """After one token of each of several sequences: their new states and last convolution inputs
    (``seq [B, K, C]``'s last K - 1) into ``slots`` (or ``out_slots``), and into each checkpoint
    slot the pass asks for after them (``AttnBatch.snaps``)."""
    dst = slots if out_slots is None else out_slots
    ssm.index_copy_(0, dst, state)
    conv.index_copy_(0, dst, seq[:, 1:])
    for j, i in enumerate(seqs):
        for _, ck in batch.snaps(i):
            ssm[ck].copy_(state[j])
            conv[ck].copy_(seq[j, 1:])


def chain_waves(singles, batch, device: torch.device):
    """The one-token sequences ``singles`` ((index, row) pairs) of a pass with chained rows, in
    waves: wave w holds the w-th row of every chain. Each: (sequences, rows, the slots their
    states are read from: the row before in the chain's, else the sequence's own, the slots they
    are written to), the last three as device tensors."""
    waves: dict[int, list[tuple[int, int, int, int]]] = {}
    depth = {}
    for i, r in singles:
        cont, dst = batch.chain_host[i]
        depth[i] = depth[i - 1] + 1 if cont and i - 1 in depth else 0
        read = batch.chain_host[i - 1][1] if depth[i] else batch.state_slots[i]
        waves.setdefault(depth[i], []).append((i, r, read, dst))
    for w in sorted(waves):
        seqs, rows, reads, dsts = zip(*waves[w])
        yield (seqs, *(torch.tensor(v, device=device) for v in (rows, reads, dsts)))


class GatedDeltaNet(nn.Module):
    """Checkpoint names as Qwen3.5 writes them (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``); Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (grouped per key head) are
    reordered into that layout when loaded (``models/qwen3_next.py``). ``fuse()`` joins the four
    into one projection."""
    #: a prompt's chunk of tokens (``delta_rule_chunked``'s contract)
    chunked = staticmethod(delta_rule_chunked)

    def __init__(self, hidden: int, lin: LinearAttnConfig, state_index: int, eps: float):
        super().__init__()
        self.lin, self.state_index, self.eps = lin, state_index, eps
        kd, vd = lin.k_heads * lin.k_dim, lin.v_heads * lin.v_dim
        self.sizes = (2 * kd + vd, vd, lin.v_heads, lin.v_heads)               # qkv, z, b, a
        self.in_proj_qkv = nn.Linear(hidden, self.sizes[0], bias=False)
        self.in_proj_z = nn.Linear(hidden, vd, bias=False)
        self.in_proj_b = nn.Linear(hidden, lin.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, lin.v_heads, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(lin.v_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(lin.v_dim))
        self.out_proj = nn.Linear(vd, hidden, bias=False)
        self.proj: torch.Tensor | None = None
        self.states = None                     # the StatePool, attached by the runner

    def fuse(self) -> None:
        with torch.no_grad():
            self.proj = torch.cat([self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight,
                                   self.in_proj_a.weight])
            self.conv_w = self.conv1d.weight[:, 0, :].contiguous()          # [C, K]
            self.neg_a = -self.A_log.float().exp()                           # g = neg_a * softplus(a + dt_bias)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.conv1d

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        lin, pool = self.lin, self.states
        proj = linear(x, self.proj, None)
        conv, ssm = pool.conv[self.state_index], pool.ssm[self.state_index]
        gpu = self._decode_kernels(x, batch)
        if gpu is not None:           # a decode step on a GPU: two launches (kernels/triton/deltanet.py)
            c = self.sizes[0]
            y = gpu.conv_step(proj[:, :c], conv, batch.state_index, self.conv_w, chain=batch.state_chain)
            return self.out_proj(gpu.recurrent_step(y, proj[:, c:], ssm, batch.state_index, self.neg_a,
                                                    self.dt_bias, self.norm.weight, lin.k_heads, self.eps,
                                                    chain=batch.state_chain))
        mixed, z, b, a = proj.split(self.sizes, -1)
        beta = b.sigmoid().float()                 # in the model's dtype first, as the reference
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        core = self._mix(x, batch, mixed, g, beta, conv, ssm)
        out = self._gated_norm(core, z.view(-1, lin.v_heads, lin.v_dim))
        return self.out_proj(out.reshape(x.shape[0], -1))

    def _mix(self, x: torch.Tensor, batch, mixed, g, beta, conv, ssm) -> torch.Tensor:
        """The heads' outputs ``[T, v_heads, v_dim]`` of a pass on the torch path: each sequence's
        rows from its own state (``each_sequence``), prompts' chunks in the chunked form."""
        core = x.new_empty((x.shape[0], self.lin.v_heads, self.lin.v_dim))
        each_sequence(
            batch, x.device, core, "chained decode rows need the Triton decode kernels in a captured step",
            chunk=lambda i, at, n: self._chunk(mixed[at:at + n], g[at:at + n], beta[at:at + n], batch.state_slots[i],
                                               batch.fresh(i), batch.snaps(i), conv, ssm),
            singles=lambda rows, slots, seqs, out_slots=None: self._singles(
                rows, slots, seqs, mixed, g, beta, batch, conv, ssm, core, out_slots=out_slots))
        return core

    def _decode_kernels(self, x: torch.Tensor, batch):
        """The Triton decode step when this pass is one token per sequence, none starting and no
        checkpoint to copy, on a GPU that runs it; else None."""
        if x.device.type != "cuda" or batch.state_index is None or batch.snapshots is not None:
            return None
        if batch.seq_counts is not None and (batch.q_max != 1 or any(map(batch.fresh, range(len(batch.seq_counts))))):
            return None
        gpu = gpu_decode_kernels("deltanet")
        return gpu if gpu is not None and gpu.supported(x, self.lin.k_dim, self.lin.v_dim) else None

    def _chunk_kernel(self, x: torch.Tensor):
        """The Triton state hand-over for a prompt's chunks on a GPU that runs it; else None."""
        if x.device.type != "cuda":
            return None
        gpu = gpu_decode_kernels("deltanet_chunk")
        return gpu if gpu is not None and gpu.supported(self.lin.k_dim, self.lin.v_dim, CHUNK) else None

    def _qkv(self, mixed: torch.Tensor):
        """The convolved ``mixed [n, C]`` -> q, k [n, v_heads, k_dim] (normalised, q scaled) and
        v [n, v_heads, v_dim], float32."""
        lin = self.lin
        kd = lin.k_heads * lin.k_dim
        q, k, v = mixed.float().split((kd, kd, lin.v_heads * lin.v_dim), -1)
        rep = lin.v_heads // lin.k_heads
        q = l2_normalise(q.view(-1, lin.k_heads, lin.k_dim)) * lin.k_dim ** -0.5
        k = l2_normalise(k.view(-1, lin.k_heads, lin.k_dim))
        if rep > 1:
            q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
        return q, k, v.view(-1, lin.v_heads, lin.v_dim)

    def _chunk(self, mixed, g, beta, slot: int, fresh: bool, snaps, conv, ssm) -> torch.Tensor:
        """A prompt's chunk of one sequence; ``snaps``: (offset in the chunk, checkpoint slot) to
        copy the state after."""
        past = conv[slot].zero_() if fresh else conv[slot]
        state = ssm[slot].zero_() if fresh else ssm[slot]
        y, _ = causal_conv(mixed, past, self.conv_w)
        seq = torch.cat((past.to(mixed.dtype), mixed))             # the raw inputs, for the conv states
        q, k, v = self._qkv(y)
        width = self.conv_w.shape[1] - 1
        kernel = self._chunk_kernel(mixed)

        def run(at: int, end: int, state: torch.Tensor):
            steps = end - at <= STEPS and mixed.device.type == "cpu"
            return (delta_rule_steps if steps else partial(self.chunked, kernel=kernel))(
                q[at:end], k[at:end], v[at:end], g[at:end], beta[at:end], state)
        return in_segments(mixed.shape[0], snaps, run, state, ssm, conv, seq, slot, width).to(mixed.dtype)

    def chains(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this layer runs chained decode rows (``AttnBatch.state_chain``) in a pass on
        ``device``: the torch path on the CPU (eager, in waves), the Triton decode kernels on a
        GPU (captured too); a GPU without them (torch's ops, captured) cannot."""
        if device.type != "cuda":
            return True
        gpu = gpu_decode_kernels("deltanet")
        return gpu is not None and gpu.supported(torch.empty(0, dtype=dtype), self.lin.k_dim, self.lin.v_dim)

    def _singles(self, rows, slots, seqs, mixed, g, beta, batch, conv, ssm, core, out_slots=None) -> None:
        """One token of each of several sequences, together: ``rows`` of the pass (None: all)
        whose states are in ``slots`` (device tensors; written back there, or to ``out_slots``);
        ``seqs``: their sequences' indices in the batch, for the host's metadata (empty in a
        captured step, which has none to act on)."""
        past, state = take_states(conv, ssm, slots, seqs, batch)
        m = mixed if rows is None else mixed.index_select(0, rows)                  # [B, C]
        if rows is not None:
            g, beta = g.index_select(0, rows), beta.index_select(0, rows)
        seq = torch.cat((past.to(m.dtype), m[:, None]), 1)                         # [B, K, C]
        y = F.silu(F.conv1d(seq.transpose(1, 2).to(self.conv_w.dtype), self.conv_w[:, None, :],
                            groups=self.conv_w.shape[0])[..., 0]).to(m.dtype)
        q, k, v = self._qkv(y)
        o, state = delta_rule_step(q, k, v, g, beta, state)
        if rows is None:
            core.copy_(o.to(core.dtype))
        else:
            core.index_copy_(0, rows, o.to(core.dtype))
        keep_states(ssm, conv, slots, out_slots, state, seq, seqs, batch)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Each head's output RMS-normed (float32), scaled, then times SiLU(z), in the model's dtype."""
        dtype = o.dtype
        normed = o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.norm.weight * normed.to(dtype)) * F.silu(z.float())).to(dtype)
