"""The decoder-only transformer that every supported family composes.

Module names mirror the Hugging Face layout (``model.layers.{i}.self_attn.q_proj`` ...) so a
checkpoint's non-expert tensors load by name; routed experts live in the expert bank instead.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig, RopeConfig
from ..layers.attention import Attention
from ..layers.batch import AttnBatch
from ..layers.deltanet import GatedDeltaNet
from ..layers.linear import linear
from ..layers.kda import KimiDeltaAttention
from ..layers.mamba2 import Mamba2
from ..layers.mla import LatentAttention
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoE
from ..layers.norm import RMSNorm, hidden_norm
from ..layers.rope import Rotary
from ..layers.shortconv import ShortConv


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, rotary: Rotary, moe_index: int | None = None):
        """Layer ``i`` of ``cfg``; ``moe_index``: a MoE layer whose routed experts are the expert
        bank's layer ``moe_index`` (the MTP layer, which follows the model's own)."""
        super().__init__()
        self.post_norms = cfg.post_norms
        if self.post_norms:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.input_layernorm = hidden_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_norm, cfg.layer_norm_bias)
        if i in cfg.linear_layers:           # a hybrid model's recurrent layer: no KV
            self.self_attn = None
            index = cfg.linear_layers.index(i)
            if cfg.linear.kind == "short_conv":
                self.linear_attn = ShortConv(cfg.hidden_size, cfg.linear, index)
            elif cfg.linear.kind == "mamba2":
                self.linear_attn = Mamba2(cfg.hidden_size, cfg.linear, index, cfg.rms_norm_eps)
            elif cfg.linear.kind == "kda":
                self.linear_attn = KimiDeltaAttention(cfg.hidden_size, cfg.linear, index, cfg.rms_norm_eps)
            else:
                self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear, index, cfg.rms_norm_eps)
        else:
            self.self_attn = (Attention if cfg.mla is None else LatentAttention)(cfg, i, rotary)
        self.parallel = cfg.parallel_block   # Cohere: one norm, attention and MLP side by side
        if not self.parallel:
            self.post_attention_layernorm = hidden_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_norm,
                                                        cfg.layer_norm_bias)
        self.sandwich = cfg.sandwich_norms       # post_attention_layernorm norms the attention's output
        # A.X-K1: a MoE layer's MLP output normed before the residual add
        self.moe_post = cfg.moe_post_norm and (moe_index is not None or i in cfg.moe_layers)
        if self.sandwich:
            self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sandwich or self.moe_post:
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe_index is not None or i in cfg.moe_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.moe_layers.index(i) if moe_index is None else moe_index)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    @property
    def plain(self) -> bool:
        """Pre-norm: ``attend``, then the MLP of its norm onto its residual (most families)."""
        return not (self.post_norms or self.parallel or self.sandwich or self.moe_post)

    def _mix(self, x, batch, cos, sin, k_cache, v_cache):
        """The token mixer on the normed ``x``: attention, or the recurrent layer of a hybrid."""
        return self.linear_attn(x, batch) if self.self_attn is None else self.self_attn(x, batch, cos, sin, k_cache, v_cache)

    def attend(self, h, batch, cos, sin, k_cache, v_cache):
        """A plain layer's first half: ``(h + attention(norm(h)), its norm)``, the MLP's residual and input."""
        x = self.input_layernorm(h)
        return self.post_attention_layernorm.add_forward(self._mix(x, batch, cos, sin, k_cache, v_cache), h)

    def forward(self, h, batch, cos, sin, k_cache, v_cache):
        if self.plain:
            h, x = self.attend(h, batch, cos, sin, k_cache, v_cache)
            return self.mlp(x, residual=h)                               # h + mlp(x)
        if self.post_norms:                 # OLMo 2: the branches' outputs normed, not their inputs
            h = h + self.post_attention_layernorm(self.self_attn(h, batch, cos, sin, k_cache, v_cache))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        x = self.input_layernorm(h)
        a = self._mix(x, batch, cos, sin, k_cache, v_cache)
        if self.parallel:
            return self.mlp(x, residual=h + a)
        if self.sandwich:
            h, x = self.pre_mlp_layernorm.add_forward(self.post_attention_layernorm(a), h)
            return h + self.post_mlp_layernorm(self.mlp(x))
        h, x = self.post_attention_layernorm.add_forward(a, h)           # moe_post
        return h + self.post_mlp_layernorm(self.mlp(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = hidden_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_norm, cfg.layer_norm_bias)


class MtpHead(nn.Module):
    """A checkpoint's multi-token-prediction layer (Qwen3-Next, Qwen3.5/3.6: ``mtp.*``), trained
    beside the model to predict the token after next: at position i it takes the model's final
    hidden state there (after the final norm) and the embedding of token i + 1, each normed,
    joins them through ``fc`` and runs one full-attention decoder layer (its own KV, its own
    routed and shared experts) and a norm; the model's LM head reads the result. Fed its own
    output and its own guess, it drafts further tokens (``executor/mtp.py``)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, cfg.num_layers, rotary, moe_index=len(cfg.moe_layers))])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    """``forward(ids [T], batch, kv, logits_at [B]) -> logits [B, V]`` (float32). With an MTP head
    (``cfg.use_mtp``) each pass also leaves every row's final hidden state in ``last_hidden``
    ``[T, H]`` (after the final norm), which ``mtp_forward`` takes."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary):
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        # layers whose rotary is not the model's own (Granite swash's bases, OLMo 3's sliding
        # layers): one more Rotary per kind, made on first use (the model is built on the meta device)
        self.layer_rope = [r if r != cfg.rope and i not in cfg.nope_layers else None
                           for i, r in enumerate(cfg.layer_ropes or [None] * cfg.num_layers)]
        self.other_rotaries: dict[RopeConfig, Rotary] = {}
        self.model = Backbone(cfg, rotary)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=cfg.lm_head_bias)
        kv_of = {layer: j for j, layer in enumerate(cfg.attention_layers)}
        self.kv_of = [kv_of.get(i) for i in range(cfg.num_layers)]     # each layer's KV pool layer (None: none)
        self.mtp = MtpHead(cfg, rotary) if cfg.use_mtp else None
        self.last_hidden: torch.Tensor | None = None
        self.embed_dtype: torch.dtype | None = None    # the rows' dtype when the table is kept narrower
        self.cpu_decode = None      # a CPU engine's fused decode layers (executor/cpu_decode.py), the runner's

    def rotaries(self) -> list[Rotary]:
        """Every rotary the layers use: the model's, then one per other kind."""
        for rope in self.layer_rope:
            if rope is not None and rope not in self.other_rotaries:
                self.other_rotaries[rope] = Rotary(rope, self.cfg.rotary_dim, self.cfg.max_position_embeddings,
                                                   self.rotary.inv_freq.device)
        return [self.rotary, *self.other_rotaries.values()]

    def moe_blocks(self) -> list[SparseMoE]:
        layers = [*self.model.layers, *(self.mtp.layers if self.mtp is not None else ())]
        return [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoE)]

    def narrowable(self, tied: bool) -> set[str]:
        """The parameters a CPU engine computing in float32 keeps in bfloat16 where the checkpoint
        stores them so (``models/build``): the projections of the plain attention and gated MLPs
        and the LM head, which reach their weights only through ``layers/linear.linear`` (the
        compiled kernel reads bfloat16 rows for float32 tokens; prefill widens them), and the
        embedding table (``embed`` widens the rows it gathers; a tied LM head reads it too)."""
        names = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight", "lm_head.bias"})
        for prefix, mod in self.named_modules():
            if type(mod) in (Attention, GatedMLP):
                for child, sub in mod.named_children():
                    if isinstance(sub, nn.Linear):
                        names |= {f"{prefix}.{child}.weight", f"{prefix}.{child}.bias"}
        return names

    def narrow(self, name: str) -> nn.Parameter:
        """Parameter ``name`` made an empty bfloat16 one (loaded next, exactly: a bfloat16 tensor)."""
        owner, attr = name.rsplit(".", 1)
        mod = self.get_submodule(owner)
        old = getattr(mod, attr)
        new = nn.Parameter(torch.empty(old.shape, dtype=torch.bfloat16, device=old.device), requires_grad=old.requires_grad)
        setattr(mod, attr, new)
        if name == "model.embed_tokens.weight":
            self.embed_dtype = old.dtype
        return new

    def deltanets(self) -> list[GatedDeltaNet | ShortConv | Mamba2]:
        return [layer.linear_attn for layer in self.model.layers if layer.self_attn is None]

    def forward(self, ids: torch.Tensor, batch: AttnBatch, kv, logits_at: torch.Tensor,
                between: Callable[[int], None] | None = None) -> torch.Tensor:
        """``between(i)``, when given, is called after layer i's work is queued, for every layer
        but the last (the scheduler runs other sequences' decode steps there)."""
        h = self.embed(ids)                                               # [T, H]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype, batch.max_position)   # [T, 1, d]
        unrotated = (torch.ones_like(cos), torch.zeros_like(sin)) if self.cfg.nope_layers else None
        by_rope = {}                                                      # layers with a rotary of their own
        if self.cfg.layer_ropes:
            self.rotaries()
            by_rope = {r: rot.cos_sin(batch.positions, h.dtype, batch.max_position)
                       for r, rot in self.other_rotaries.items()}
        last = len(self.model.layers) - 1
        view = kv.window_view(batch) if kv.window else None    # the sliding-window layers' slots
        fused = self.cpu_decode.begin(h, batch, between) if self.cpu_decode is not None else None
        for i, layer in enumerate(self.model.layers):
            j = self.kv_of[i]
            c, s = unrotated if i in self.cfg.nope_layers else by_rope.get(self.layer_rope[i], (cos, sin))
            k, v = kv.caches(j) if j is not None else (None, None)
            b = view if view is not None and j is not None and kv.windowed(j) else batch
            out = fused.run(i, h, b, c, s, k, v) if fused is not None else None
            h = out if out is not None else layer(h, b, c, s, k, v)
            if between is not None and i < last:
                between(i)
        if self.mtp is not None:                                          # every row, for the MTP head
            self.last_hidden = h = self.model.norm(h)
            if h.shape[0] != logits_at.shape[0]:
                h = h.index_select(0, logits_at)
        else:
            if h.shape[0] != logits_at.shape[0]:                          # keep each sequence's last row
                h = h.index_select(0, logits_at)
            h = self.model.norm(h)
        return self.logits(h)                                             # [B, V]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        if self.embed_dtype is not None:
            h = h.to(self.embed_dtype)
        return h if self.cfg.embedding_multiplier == 1.0 else h * self.cfg.embedding_multiplier

    def logits(self, h: torch.Tensor, vocab: int = 0) -> torch.Tensor:
        """float32 logits of final hidden states (after their norm); ``vocab``: of the first
        ``vocab`` token ids only (0: all)."""
        head = self.lm_head
        logits = head(h) if not 0 < vocab < self.cfg.vocab_size else \
            linear(h, head.weight[:vocab], None if head.bias is None else head.bias[:vocab])
        logits = logits if logits.dtype == torch.float32 else logits.float()
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling

    def mtp_forward(self, ids: torch.Tensor, hidden: torch.Tensor, batch: AttnBatch, kv,
                    rows: torch.Tensor) -> torch.Tensor:
        """The MTP layer over ``T`` rows: ``ids [T]`` the token after each row's position
        (``batch.positions``), ``hidden [T, H]`` the hidden state at that position (the model's,
        after its final norm, or the MTP head's own when drafting on); its KV goes to the pool's
        last layer. -> the MTP head's output at ``rows`` (after its norm): ``logits`` of it
        predict the token after ``ids``. With ``mtp_zero_first`` (GLM, DeepSeek: as vLLM runs
        them) the row at position 0 takes a zero embedding."""
        m = self.mtp
        e = self.embed(ids)
        if self.cfg.mtp_zero_first:
            e = e.masked_fill((batch.positions == 0)[:, None], 0.0)
        e = m.pre_fc_norm_embedding(e)
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype, batch.max_position)
        j = self.cfg.kv_layers - 1
        h = m.layers[0](x, batch, cos, sin, *kv.caches(j))
        if h.shape[0] != rows.shape[0]:
            h = h.index_select(0, rows)
        return m.norm(h)
