"""GGUF loading for llama-architecture models (the file read by `gguf_file.py`, dequantized by the
`gguf` package).

Contract:

    model = load_gguf(path, dtype=torch.float32)     # -> GGUFModel
    model.config            # a Hugging Face llama config.json dict
    model.tensors           # {HF key: Tensor}, dequantized to `dtype`, in the HF layout
    model.tokenizer_json    # a `tokenizers` Tokenizer JSON (byte-level BPE from the GGUF vocab)
    model.tokenizer_config  # {"chat_template", "bos_token", "eos_token", ...}
    write_hf_folder(model, out_dir)   # config.json, model.safetensors, tokenizer.json,
                                      # tokenizer_config.json, generation_config.json

llama.cpp stores the Q and K projections with their rows permuted for its rope layout
(within each head, the two rotary halves are interleaved). `load_gguf` undoes that, so the
folder it writes is the checkpoint `transformers`' LlamaForCausalLM expects.

Raises `GGUFError` (a ValueError) for a file that is not a readable llama GGUF.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .gguf_file import GGUFError, GGUFFile

__all__ = ["GGUFError", "GGUFModel", "load_gguf", "write_hf_folder", "read_metadata"]


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
}
_GLOBAL_KEYS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SPECIAL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED


def read_metadata(path: str | Path) -> dict:
    """All scalar/string/array metadata fields of a GGUF file, as Python values."""
    return GGUFFile(path).metadata


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves (rows of Q or K)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama_config(meta: dict, vocab_size: int, has_output: bool) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (only 'llama')")

    def need(key):
        if f"llama.{key}" not in meta:
            raise GGUFError(f"GGUF metadata lacks llama.{key}")
        return meta[f"llama.{key}"]

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", vocab_size)),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    kind = meta.get("llama.rope.scaling.type")  # no "rope_scaling" key at all when absent
    if kind and kind != "none":
        cfg["rope_scaling"] = {
            "rope_type": kind,
            "factor": float(meta.get("llama.rope.scaling.factor", 1.0)),
        }
        if "llama.rope.scaling.original_context_length" in meta:
            cfg["rope_scaling"]["original_max_position_embeddings"] = int(
                meta["llama.rope.scaling.original_context_length"]
            )
    return cfg


def _tokenizer(meta: dict) -> tuple[str, dict]:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) rebuilt with `tokenizers`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (only gpt2 BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm"/"starcoder"-style pre-tokenizers split every digit on its own first.
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2", "deepseek-coder"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
    )

    def name(key):
        idx = meta.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tcfg["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), tcfg


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read and dequantize a llama GGUF file into HF key names and layout (see module doc)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    reader = GGUFFile(path)
    meta = reader.metadata
    names = {t.name for t in reader.tensors}
    cfg = _llama_config(meta, len(meta.get("tokenizer.ggml.tokens", [])), "output.weight" in names)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_KEYS:
            key = _GLOBAL_KEYS[t.name]
        elif t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _BLOCK_KEYS:
                continue  # e.g. rope_freqs: recomputed from the config
            key = f"model.layers.{int(layer)}.{_BLOCK_KEYS[rest]}"
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
        if key.endswith("q_proj.weight"):
            w = _unpermute_rope(w, n_head)
        elif key.endswith("k_proj.weight"):
            w = _unpermute_rope(w, n_kv)
        tensors[key] = w.to(dtype).contiguous()

    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in tensors]
    if missing:
        raise GGUFError(f"GGUF file {path} lacks tensors {missing}")
    tok_json, tok_cfg = _tokenizer(meta)
    small_meta = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
    return GGUFModel(cfg, tensors, tok_json, tok_cfg, small_meta)


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
