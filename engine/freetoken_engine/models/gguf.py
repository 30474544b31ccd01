"""GGUF loading (the file read by `gguf_file.py`, dequantized by the `gguf` package) for the
`llama` architecture (Mixtral too: llama's layout with `llama.expert_count` experts), Qwen2/2.5's
(`qwen2`), Qwen3's,
dense (`qwen3`) and MoE (`qwen3moe`: Qwen3-30B-A3B and -235B-A22B as llama.cpp's converter writes
them), Qwen2-MoE's (`qwen2moe`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), MiniMax-M2's (`minimax-m2`) and
GLM-4.5's (`glm4moe`: GLM-4.5/4.6/4.7 and -Air; its multi-token-prediction blocks are left unread),
experts stacked per layer in `ffn_*_exps`.

Contract:

    model = load_gguf(path, dtype=torch.float32)     # -> GGUFModel
    model.config            # a Hugging Face llama config.json dict
    model.tensors           # {HF key: Tensor}, dequantized to `dtype`, in the HF layout
    model.tokenizer_json    # a `tokenizers` Tokenizer JSON (byte-level BPE from the GGUF vocab)
    model.tokenizer_config  # {"chat_template", "bos_token", "eos_token", ...}
    write_hf_folder(model, out_dir)   # config.json, model.safetensors, tokenizer.json,
                                      # tokenizer_config.json, generation_config.json

    convert_gguf(path, out_dir)      # the same folder, written a layer at a time (sharded, each
                                     # expert its own tensors): a large MoE never whole in memory

llama.cpp stores a llama's Q and K projections with their rows permuted for its rope layout
(within each head, the two rotary halves are interleaved). `load_gguf` undoes that, so the
folder it writes is the checkpoint `transformers`' LlamaForCausalLM expects (Qwen's are stored
as they are).

Raises `GGUFError` (a ValueError) for a file that is not a readable GGUF of those architectures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .gguf_file import GGUFError, GGUFFile
from .gguf_tokenizer import tokenizer_files

__all__ = ["GGUFError", "GGUFModel", "convert_gguf", "load_gguf", "write_hf_folder", "read_metadata"]


@dataclass
class GGUFModel:
    """A dequantized llama checkpoint read from one GGUF file (see the module docstring)."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str
    tokenizer_config: dict
    metadata: dict = field(default_factory=dict)


# GGUF tensor name (per block) -> HF name
_BLOCK_KEYS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "exp_probs_b.bias": "mlp.e_score_correction_bias",                # MiniMax-M2's routing bias
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",     # [H] in the file, [1, H] here
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# stacked experts [E, rows, cols] -> each expert's tensor
_EXPERT_KEYS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                "ffn_down_exps.weight": "down_proj"}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GLOBAL_KEYS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
FLOAT32_LIMIT = 8 << 30        # convert_gguf: larger models are written in bfloat16


def read_metadata(path: str | Path) -> dict:
    """All scalar/string/array metadata fields of a GGUF file, as Python values."""
    return GGUFFile(path).metadata


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves (rows of Q or K)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
          "qwen3": ("qwen3", "Qwen3ForCausalLM"),
          "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"), "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
          "minimax-m2": ("minimax_m2", "MiniMaxM2ForCausalLM"), "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM")}
# names an architecture gives otherwise (GLM's shared experts are plural, its routing bias on the gate)
_ARCH_KEYS = {"glm4moe": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                          "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
                          "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                          "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                          "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}}


def _config(meta: dict, vocab_size: int, names: set[str]) -> dict:
    """The Hugging Face ``config.json`` of a GGUF file's metadata."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")

    def need(key):
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    model_type, architecture = _ARCHS[arch]
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": int(meta.get(f"{arch}.vocab_size", vocab_size)),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "llama" and meta.get("llama.expert_count"):      # Mixtral: llama's layout with experts
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   num_local_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")))
    if arch == "qwen3moe":          # llama.cpp renormalises Qwen3-MoE's top k (no metadata says so)
        cfg.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")), norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2moe":          # Qwen1.5-MoE, Qwen2-57B-A14B: a gated shared expert, q/k/v biases
        cfg.update(num_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(need("expert_shared_feed_forward_length")),
                   norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
    if arch == "minimax-m2":        # sigmoid routing with its bias, q/k norms over the whole projection
        rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        cfg.update(num_local_experts=int(need("expert_count")), num_experts_per_tok=int(need("expert_used_count")),
                   intermediate_size=int(need("expert_feed_forward_length")), rotary_dim=rotary,
                   partial_rotary_factor=rotary / head_dim, scoring_func="sigmoid", use_routing_bias=True,
                   use_qk_norm=True, qk_norm_type="per_layer")
    if arch == "glm4moe":           # GLM-4.5/4.6/4.7, -Air: its multi-token-prediction blocks are counted in
        nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))     # block_count, and not run here
        rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        cfg.update(num_hidden_layers=cfg["num_hidden_layers"] - nextn, n_routed_experts=int(need("expert_count")),
                   num_experts_per_tok=int(need("expert_used_count")),
                   moe_intermediate_size=int(need("expert_feed_forward_length")),
                   n_shared_experts=int(meta.get(f"{arch}.expert_shared_count", 1)),
                   first_k_dense_replace=int(meta.get(f"{arch}.leading_dense_block_count", 1)),
                   routed_scaling_factor=float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
                   norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)), n_group=1, topk_group=1,
                   partial_rotary_factor=rotary / head_dim, num_nextn_predict_layers=0,
                   attention_bias=any(t.endswith("attn_q.bias") for t in names),
                   use_qk_norm=any(t.endswith("attn_q_norm.weight") for t in names))
    kind = meta.get(f"{arch}.rope.scaling.type")  # no "rope_scaling" key at all when absent
    if kind and kind != "none":
        cfg["rope_scaling"] = {
            "rope_type": kind,
            "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
        if f"{arch}.rope.scaling.original_context_length" in meta:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                meta[f"{arch}.rope.scaling.original_context_length"]
            )
    return cfg


def _read(path: Path) -> tuple[GGUFFile, dict]:
    reader = GGUFFile(path)
    meta = reader.metadata
    names = {t.name for t in reader.tensors}
    return reader, _config(meta, len(meta.get("tokenizer.ggml.tokens", [])), names)


def iter_tensors(reader: GGUFFile, cfg: dict, dtype: torch.dtype):
    """(HF key, tensor) of each tensor the model runs, dequantized to ``dtype`` one GGUF tensor
    at a time, in the file's order (a stacked expert tensor as its experts' own)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    permute = cfg["model_type"] in ("llama", "mixtral")
    own = _ARCH_KEYS.get(reader.metadata.get("general.architecture"), {})
    layers = cfg["num_hidden_layers"]
    mixtral = cfg["model_type"] in ("mixtral", "minimax_m2")     # Mixtral's MoE block and expert names
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in reader.tensors:
        experts = None
        if t.name in _GLOBAL_KEYS:
            key = _GLOBAL_KEYS[t.name]
        elif t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if int(layer) >= layers:
                continue  # a multi-token-prediction block (GLM's nextn)
            if rest in own:
                key = f"model.layers.{int(layer)}.{own[rest]}"
            elif rest in _EXPERT_KEYS:
                key, experts = f"model.layers.{int(layer)}.mlp.experts", _EXPERT_KEYS[rest]
            elif rest in _BLOCK_KEYS:
                key = f"model.layers.{int(layer)}.{_BLOCK_KEYS[rest]}"
            else:
                continue  # e.g. rope_freqs: recomputed from the config
        else:
            continue
        shape = tuple(reversed(t.ne))  # GGUF lists ne0 (columns) first
        qtype = t.qtype
        try:
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.asarray(t.raw, dtype=np.float32)
            else:
                arr = dequantize(t.raw, qtype)
        except (NotImplementedError, ValueError) as exc:
            raise GGUFError(f"cannot dequantize {t.name} ({qtype.name}): {exc}") from exc
        w = torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32, copy=True))
        if mixtral:
            key = key.replace(".mlp.", ".block_sparse_moe.")
        if experts is not None:
            name = _MIXTRAL_EXPERTS[experts] if mixtral else experts
            for e in range(w.shape[0]):
                yield f"{key}.{e}.{name}.weight", w[e].to(dtype).contiguous()
            continue
        if key.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)
        if permute and key.endswith("q_proj.weight"):
            w = _unpermute_rope(w, n_head)
        elif permute and key.endswith("k_proj.weight"):
            w = _unpermute_rope(w, n_kv)
        yield key, w.to(dtype).contiguous()


def _check(path: Path, keys) -> None:
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in keys]
    if missing:
        raise GGUFError(f"GGUF file {path} lacks tensors {missing}")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read and dequantize a GGUF file into HF key names and layout (see module doc)."""
    path = Path(path)
    reader, cfg = _read(path)
    tensors = dict(iter_tensors(reader, cfg, dtype))
    _check(path, tensors)
    meta = reader.metadata
    tok_json, tok_cfg = tokenizer_files(meta)
    small_meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
    return GGUFModel(cfg, tensors, tok_json, tok_cfg, small_meta)


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """``path`` as a Hugging Face folder in ``out_dir``, a shard per layer: float32 (the exact
    dequantized values) up to ``FLOAT32_LIMIT`` bytes of them, bfloat16 above (the dtype the
    engine runs on a GPU; a 30B MoE in float32 would be 120 GB); only one GGUF tensor is
    dequantized at a time, so a file larger than memory converts (bench/gguf_convert_memory.py: a
    0.95 GB Q8_0 Qwen3-MoE file, peak RSS growth 1.32 GB, of it the file's own mapped pages, against
    4.65 GB reading it whole; 8 layers: 0.84 against 2.40 GB)."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out_dir)
    reader, cfg = _read(path)
    numel = sum(int(np.prod(t.ne)) for t in reader.tensors)
    dtype = torch.float32 if 4 * numel <= FLOAT32_LIMIT else torch.bfloat16
    tok_json, tok_cfg = tokenizer_files(reader.metadata)
    out.mkdir(parents=True, exist_ok=True)
    index, shard, part, size = {}, {}, 0, 0

    def flush():
        nonlocal shard, part
        if shard:
            name = f"model-{part:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, name))
            shard, part = {}, part + 1

    layer = None
    for key, w in iter_tensors(reader, cfg, dtype):
        now = key.split(".")[2] if key.startswith("model.layers.") else None
        if now != layer:                         # a shard per layer (and one for the rest)
            flush()
            layer = now
        shard[key] = w
        size += w.numel() * w.element_size()
    flush()
    _check(path, index)
    cfg = dict(cfg, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": size},
                                                                  "weight_map": index}, indent=1))
    write_tokenizer_files(GGUFModel(cfg, {}, tok_json, tok_cfg), out)
    return out


def write_tokenizer_files(model: GGUFModel, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json of `model`."""
    (out_dir / "tokenizer.json").write_text(model.tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(model.tokenizer_config, indent=2))
    gen = {
        "bos_token_id": model.config.get("bos_token_id"),
        "eos_token_id": model.config.get("eos_token_id"),
        "pad_token_id": model.config.get("pad_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_hf_folder(model: GGUFModel, out_dir: str | Path) -> Path:
    """Write `model` as a dense Hugging Face llama folder (safetensors in the hub's key layout)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(model.config)
    dtypes = {t.dtype for t in model.tensors.values()}
    cfg["torch_dtype"] = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in model.tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer_files(model, out)
    return out
