"""The CPU engine's decode passes through fused layers (kernels/cpu/layer.py).

``CpuDecode(model, experts, dtype)`` (the runner's, on a CPU engine) keeps a
``FusedLayer`` for every layer that qualifies, and the model's forward asks ``begin`` at the
start of each pass: for a decode pass of at most 8 rows on the CPU it returns a ``FusedPass``
whose ``run`` does a layer's step in two compiled calls around the model's own router, else
None (the modules run). Layers that do not qualify run their modules inside a fused pass too.

A pre-norm layer (``DecoderLayer.plain``) is fused whole when its attention is what
``ft_layer_attn`` chains (RMSNorm; fused q/k/v; no clip, gate or temperature; per-head q/k norms
or none; sinks and windows allowed) and its MLP is either a MoE block computed from the host
bank in place or a dense gated MLP (its module runs after the fused attention half). A MoE block
qualifies with every expert resident (with an expert cache smaller than that, the modules run),
plain or gpt-oss experts in dense or MXFP4 rows, any router, a shared expert and the experts'
output biases (these run in torch on the fused call's output), and no prefetch guess and no
scaling of the routed input. Where only the MoE block qualifies (whole-projection q/k norms,
norms after the rotary, gated or latent attention, recurrent layers: the hybrids, Qwen3.6's
family among them), the layer's modules run its attention half (``DecoderLayer.attend``) and
the MoE half is fused. tests/engine/test_fused_cpu_decode.py lists the families; OLMo 2's
post-norms, Cohere's parallel blocks, Llama 4's scaled routed input do not qualify.
``EngineConfig.fused_cpu_decode=False`` turns it off.
"""
from __future__ import annotations

import logging

import torch

from ..cache.offload import OffloadedExperts
from ..kernels.reference import SILU
from ..kernels.cpu.layer import MAX_ROWS, AttnWeights, FusedLayer, Scratch, Step, projection_ok
from ..layers.attention import Attention
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm
from ..models.decoder import DecoderLayer

log = logging.getLogger(__name__)


def _attn_weights(layer: DecoderLayer, dtype: torch.dtype) -> AttnWeights | None:
    """A plain layer's attention half as the fused call takes it, or None when it does not qualify."""
    at, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if type(at) is not Attention or type(n1) is not RMSNorm or type(n2) is not RMSNorm:
        return None
    if at.qkv is None or at.clip is not None or at.gate is not None or at.temper is not None \
            or at.qk_norm in ("full", "rotated"):
        return None
    o = (at.o_proj.weight, at.o_proj.bias)
    if not (projection_ok(*at.qkv, dtype) and projection_ok(*o, dtype)):
        return None
    norms = [n1.weight, n2.weight] + ([at.q_norm.weight, at.k_norm.weight] if at.qk_norm == "head" else [])
    if any(w.dtype != dtype or not w.is_contiguous() or w.device.type != "cpu" for w in norms):
        return None
    head = at.qk_norm == "head"
    return AttnWeights(n1.weight, n1.eps, at.qkv, o, n2.weight, n2.eps, at.h, at.kvh, at.d,
                       at.q_norm.weight if head else None, at.k_norm.weight if head else None,
                       at.q_norm.eps if head else 0.0, at.scale, at.window, at.chunk,
                       None if at.sinks is None else at.sinks.detach().float().contiguous())


def _mlp_kind(mlp, experts: OffloadedExperts | None, dtype: torch.dtype) -> str | None:
    """"moe" for a MoE block the fused call computes, "dense" for a dense MLP (its module runs
    after the attention half), None for anything else (the layer stays unfused)."""
    if type(mlp) is GatedMLP:
        return "dense"
    if (isinstance(mlp, SparseMoE) and experts is not None and mlp.experts is experts and mlp.next_gate is None
            and not mlp.moe.scale_input and not mlp.moe.average_shared and experts.cpu_backend_name == "compiled"
            and (mlp.expert_b2 is None or mlp.expert_b2.dtype == dtype)):
        return "moe"
    return None


def _b13(experts: OffloadedExperts, layer: int) -> torch.Tensor | None:
    """MoE layer ``layer``'s gate/up biases as the unfused bank path hands them to the kernel
    (cache/expert_math.py): float32 host rows [E, 2I], or None."""
    b13 = experts.math.layer_b13[layer] if experts.math.layer_b13 else None
    if b13 is not None and not (b13.is_cpu and b13.dtype == torch.float32):
        b13 = experts.math.host_b13()[layer]
    return None if b13 is None else b13.detach().float().contiguous()


class CpuDecode:
    """The model's fused layers (index -> FusedLayer), made on the first decode pass and again
    whenever the bank has moved (a packed bank adopted after the start)."""

    def __init__(self, model, experts: OffloadedExperts | None, dtype: torch.dtype):
        self.model, self.experts, self.dtype = model, experts, dtype
        self.fused: dict[int, FusedLayer] = {}
        self.layers = list(model.model.layers)   # (a ModuleList's indexing costs a us a layer per pass)
        self.bank_at: int | None = None      # the bank's address the fused layers hold

    def _build(self) -> None:
        """Fused layers for the layers that qualify (see the module docstring)."""
        self.bank_at, self.fused = self._bank(), {}
        if self.dtype not in (torch.float32, torch.bfloat16):
            return
        found = {}
        for i, layer in enumerate(self.layers):
            if not (isinstance(layer, DecoderLayer) and layer.plain):
                continue
            a = _attn_weights(layer, self.dtype)
            kind = _mlp_kind(layer.mlp, self.experts, self.dtype)
            if kind == "moe" or (kind == "dense" and a is not None):     # (a MoE half alone, where a is None)
                found[i] = (a, layer.mlp.moe_layer if kind == "moe" else None)
        if not found:
            return
        attns = [a for a, _ in found.values() if a is not None]
        top_k = self.experts.top_k if self.experts is not None else 1
        scratch = Scratch(self.dtype, self.model.cfg.hidden_size, max([a.qkv[0].shape[0] for a in attns], default=1),
                          max([a.o[0].shape[1] for a in attns], default=1), top_k)
        bank = self.experts.bank if self.experts is not None else None
        for i, (a, m) in found.items():
            try:
                self.fused[i] = FusedLayer(a, None if m is None else bank.w13[m], None if m is None else bank.w2[m],
                                           top_k, scratch, i % 2, self.experts.math.act if m is not None else SILU,
                                           None if m is None else _b13(self.experts, m))
            except ValueError as exc:
                log.debug("layer %d stays unfused: %s", i, exc)
        log.info("CPU decode: %d of %d layers fused", len(self.fused), len(self.layers))

    def _bank(self) -> int:
        return self.experts.bank.w13.data_ptr() if self.experts is not None else 0

    def begin(self, h: torch.Tensor, batch, between) -> FusedPass | None:
        """A ``FusedPass`` for this pass, or None (the modules run every layer): only decode
        passes of at most 8 rows on the CPU, with the bank still every expert's home."""
        if (between is not None or batch.q_max != 1 or batch.kv_len is None or h.shape[0] > MAX_ROWS
                or h.device.type != "cpu" or (self.experts is not None and not self.experts.bank_in_place())
                or (torch.is_grad_enabled() and h.requires_grad)):
            return None
        if self._bank() != self.bank_at:
            self._build()
        return FusedPass(self, h.shape[0]) if self.fused else None


class FusedPass:
    """One decode pass: ``run(i, h, batch, cos, sin, k, v)`` is layer i's output, or None when
    layer i is not fused (its module runs)."""

    def __init__(self, owner: CpuDecode, rows: int):
        self.owner, self.rows = owner, rows
        self.steps: dict[int, Step | None] = {}

    def _step(self, batch) -> Step | None:
        """The pass's rows as ``batch`` gives them (the pass's own, or a window store's view of
        it: the caller holds both for the whole pass, so their ids stay theirs)."""
        got = self.steps.get(id(batch), False)
        if got is False:
            idx, slot, n = batch.kv_index, batch.slot_mapping, batch.kv_len
            ok = all(t.dtype == torch.int64 and t.is_contiguous() for t in (idx, slot, n))
            got = self.steps[id(batch)] = Step(self.rows, slot, idx, n, batch.write_first) if ok else None
        return got

    def run(self, i: int, h: torch.Tensor, batch, cos: torch.Tensor, sin: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        f = self.owner.fused.get(i)
        if f is None or h.dtype != self.owner.dtype:
            return None
        layer = self.owner.layers[i]
        mlp, halves = layer.mlp, None
        if f.attn_fused:
            if k is None or k.dtype != h.dtype or not (h.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
                return None
            step = self._step(batch)
            if step is None:
                return None
            step.rotary(cos, sin)
            x2 = f.attn(step, h, k, v)
            if f.dense:
                return mlp(x2, residual=f.h2(self.rows))
        else:                               # the attention half by the layer's modules
            h2, x2 = layer.attend(h, batch, cos, sin, k, v)
            if x2.dtype != h.dtype or h2.dtype != h.dtype:
                return mlp(x2, residual=h2)
            halves = (x2.contiguous(), h2.contiguous())
        weights, ids = mlp.route(x2)                                      # [B, k] each
        if weights.dtype != h.dtype or not weights.is_contiguous() or not ids.is_contiguous() \
                or ids.dtype != torch.int64:
            weights, ids = weights.to(h.dtype).contiguous(), ids.to(torch.int64).contiguous()
        shared = None if mlp.shared_expert is None else mlp.shared(x2)               # [B, H]
        if mlp.expert_b2 is not None:       # the experts' output biases, weighted (as SparseMoE.forward)
            biases = (mlp.expert_b2[ids] * weights[..., None]).sum(dim=1)
            shared = biases if shared is None else shared + biases
        out = f.moe(self.rows, ids, weights, None if shared is None else shared.contiguous(), halves)
        stats = self.owner.experts.cache.stats         # what the unfused bank path counts
        stats.hits += ids.shape[1] if self.rows == 1 else int(torch.unique(ids).numel())
        return out
