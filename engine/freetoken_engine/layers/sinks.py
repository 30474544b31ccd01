"""Attention sinks (Granite swash, gpt-oss): a learned logit per query head joins every softmax's
denominator, with no value: a query's weights over its keys sum to ``sigmoid(lse - sink)``.

torch's fused attention (SDPA, flash) takes no sink. On the CPU its flash kernel also returns
each row's log-sum-exp, and the sink is then a factor of the row (``FLASH_LSE``); elsewhere (a
GPU's chunks, or ``FLASH_LSE`` False) the layer holds its float32 scores, for as many query rows
at a time as fit ``BLOCK_BYTES``. The fused decode kernels take the sink themselves
(kernels/cpu/attention.py, kernels/triton/attention.py). ``bench/sink_attention.py`` measures the
sides against SDPA without sinks.
"""
from __future__ import annotations

import torch

#: the CPU's prompt chunks through torch's flash kernel and its log-sum-exp; False: scores held
FLASH_LSE = True
#: held scores take at most this many bytes of float32 a block of query rows
BLOCK_BYTES = 64 << 20


def softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """float32 softmax of ``scores`` over the last dimension with ``sink`` (broadcast to it, one
    value per row) one more logit in the denominator: transformers' gpt-oss form, the sink
    column's weight dropped. A row with every key masked gets weights 0, not NaN."""
    scores = scores.float()
    top = torch.maximum(scores.amax(-1, keepdim=True), sink)
    e = (scores - top).exp()
    return e / (e.sum(-1, keepdim=True) + (sink - top).exp())


def attend(attn, qp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           lower_right: bool) -> torch.Tensor:
    """``Attention._attend``'s contract (``attn`` the layer: heads, scale, sinks) with the sinks:
    qp [B, h, Q, d] over keys / values [B, kvh, L, d] -> [B, h, Q, d]."""
    b, h, q_max, _ = qp.shape
    length = keys.shape[2]
    if FLASH_LSE and qp.device.type == "cpu" and qp.dtype in (torch.float32, torch.bfloat16):
        # each KV head's g query heads as g x Q query rows of one head (the kernel takes no groups):
        # no key or value is repeated, the mask's rows are, once per query head of the group
        kvh = keys.shape[1]
        g = h // kvh
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=qp.dtype).masked_fill(~mask, float("-inf"))
            bias = bias.expand(b, 1, q_max, length).repeat(1, 1, g, 1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp.reshape(b, kvh, g * q_max, -1), keys, values, attn_mask=bias, scale=attn.scale)
        share = torch.sigmoid(lse.reshape(b, h, q_max) - attn.sinks.float().view(1, h, 1))
        return (out.reshape(qp.shape).float() * share[..., None]).to(qp.dtype)
    if lower_right:                     # a chunk's causal triangle, its last query at the last key
        mask = attn._allowed(torch.arange(length - q_max, length, device=qp.device), length)[None, None]
    rows = max(1, BLOCK_BYTES // (4 * b * h * length))
    out = torch.empty_like(qp)
    for r in range(0, q_max, rows):
        part = None if mask is None else mask[:, :, r:r + rows] if mask.shape[2] > 1 else mask
        out[:, :, r:r + rows] = attn._grouped_matmuls(qp[:, :, r:r + rows], keys, values, part)
    return out
