"""The `freetoken_llama_moe` checkpoint: a llama whose MLPs are split into routed experts.

Format (config.json = the llama fields plus):

    model_type "freetoken_llama_moe", architectures ["FreeTokenLlamaMoeForCausalLM"],
    num_experts E, num_experts_per_tok k, moe_intermediate_size I // E, router_scoring "unit"

Keys: the llama attention / norm / embedding keys unchanged, and per layer i

    model.layers.{i}.mlp.gate.weight                    [E, H]   router, linear, no bias
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight   [I_e, H]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight     [I_e, H]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight   [H, I_e]

Routing rule "unit": the k experts with the largest router logits are selected and each
selected expert's output is added with weight 1.0. Expert e owns the intermediate neurons
`perm[e*I_e:(e+1)*I_e]` of the dense MLP, so with k = E the MoE MLP is exactly the dense one.

`MoeMLP` is the readable torch reference of that MLP (used by the fitting, the benchmark and
the tests through transformers' LlamaForCausalLM); the engine has its own implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_TYPE = "freetoken_llama_moe"
ARCHITECTURE = "FreeTokenLlamaMoeForCausalLM"


def moe_config(dense_cfg: dict, num_experts: int, top_k: int) -> dict:
    """The MoE config.json dict for a dense llama config split into `num_experts` experts."""
    inter = int(dense_cfg["intermediate_size"])
    if num_experts < 1 or inter % num_experts:
        raise ValueError(f"intermediate_size {inter} is not divisible into {num_experts} experts")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
    cfg = dict(dense_cfg)
    cfg.update(
        model_type=MODEL_TYPE,
        architectures=[ARCHITECTURE],
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter // num_experts,
        router_scoring="unit",
    )
    return cfg


def split_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor,
                num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's dense MLP weights -> {"experts.{e}.{proj}.weight": tensor}."""
    inter = gate.shape[0]
    if sorted(perm.tolist()) != list(range(inter)):
        raise ValueError("perm is not a permutation of the intermediate neurons")
    size = inter // num_experts
    out = {}
    for e in range(num_experts):
        idx = perm[e * size:(e + 1) * size].long()
        out[f"experts.{e}.gate_proj.weight"] = gate[idx].contiguous()
        out[f"experts.{e}.up_proj.weight"] = up[idx].contiguous()
        out[f"experts.{e}.down_proj.weight"] = down[:, idx].contiguous()
    return out


def moe_tensors(dense: dict[str, torch.Tensor], perms: torch.Tensor, routers: torch.Tensor
                ) -> dict[str, torch.Tensor]:
    """Dense llama tensors + per-layer permutations [L, I] + routers [L, E, H] -> MoE tensors."""
    num_layers, num_experts, _ = routers.shape
    out = {k: v for k, v in dense.items() if ".mlp." not in k}
    for i in range(num_layers):
        p = f"model.layers.{i}.mlp."
        parts = split_layer(dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"],
                            dense[p + "down_proj.weight"], perms[i], num_experts)
        out.update({p + k: v for k, v in parts.items()})
        out[p + "gate.weight"] = routers[i].to(dense[p + "gate_proj.weight"].dtype).contiguous()
    return out


class MoeMLP(nn.Module):
    """Reference forward of one `freetoken_llama_moe` MLP with the "unit" routing rule."""

    def __init__(self, hidden: int, expert_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.ModuleDict({
                "gate_proj": nn.Linear(hidden, expert_size, bias=False),
                "up_proj": nn.Linear(hidden, expert_size, bias=False),
                "down_proj": nn.Linear(expert_size, hidden, bias=False),
            })
            for _ in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Selected expert ids, [T, k] for x [T, H]."""
        logits = self.gate(x)  # [T, E]
        return logits.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        chosen = self.route(x)  # [T, k]
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            rows = (chosen == e).any(dim=-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            xs = x[rows]
            y = ex["down_proj"](F.silu(ex["gate_proj"](xs)) * ex["up_proj"](xs))
            out.index_add_(0, rows, y)
        return out.reshape(shape)


def transformers_moe_model(folder, dtype=torch.float32, top_k: int | None = None):
    """Load a `freetoken_llama_moe` folder into transformers' LlamaForCausalLM with `MoeMLP`s.

    A reference for tests and benchmarks (the engine loads the folder itself). `top_k`
    overrides the config's num_experts_per_tok.
    """
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{folder} is not a {MODEL_TYPE} checkpoint")
    dense = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    model = LlamaForCausalLM(LlamaConfig(**dense)).to(dtype)
    k = top_k or cfg["num_experts_per_tok"]
    for layer in model.model.layers:
        layer.mlp = MoeMLP(cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], k).to(dtype)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.get("tie_word_embeddings", True):
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
