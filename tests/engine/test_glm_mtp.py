"""GLM-4.5's multi-token-prediction layer (DeepSeek-V3's kind, shipped as ``model.layers.{N}``)
as the engine's MTP drafter: its drafts are the ones transformers' GLM modules compute from the
same weights as vLLM runs the layer (``enorm``/``hnorm``/``eh_proj``, a full decoder layer,
``shared_head.norm``, the embedding at position 0 zeroed), the output is the plain decode's, and
a packed folder carries the layer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.executor.speculate import DraftLength
from test_mtp import GREEDY, PROMPTS, SAMPLED, plain_outputs, reference_drafts, spy_drafts, total, train_head
from tiny_models import load_reference, make_tiny_checkpoint


def glm_mtp_parts(path, seed: int = 1, family: str = "glm4_moe") -> dict:
    """A random MTP layer for the ``family`` checkpoint at ``path`` (GLM-4.5's or DeepSeek-V3's:
    one kind) from transformers' own modules of the family, written as the hub ships it
    (``model.layers.{N}.*``, experts one tensor each, the layer's copies of the embedding and LM
    head beside it); returned float32 for the reference."""
    import importlib

    import transformers as T
    G = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    stem = {"glm4_moe": "Glm4Moe", "deepseek_v3": "DeepseekV3"}[family]
    norm, layer = getattr(G, f"{stem}RMSNorm"), getattr(G, f"{stem}DecoderLayer")
    path = Path(path)
    cfg = T.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    parts = dict(enorm=norm(h, cfg.rms_norm_eps), hnorm=norm(h, cfg.rms_norm_eps),
                 eh_proj=torch.nn.Linear(2 * h, h, bias=False), layer=layer(cfg, n), norm=norm(h, cfg.rms_norm_eps))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in parts.values():
            for key, p in [*module.named_parameters(), *module.named_buffers()]:
                is_norm = key.endswith("norm.weight") or (key == "weight" and p.dim() == 1)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if is_norm else 0.2 * torch.randn(p.shape, generator=g))
    parts = {k: m.float().eval() for k, m in parts.items()}
    save_glm_mtp(path, parts)
    return parts


def save_glm_mtp(path, parts: dict) -> None:
    """Write the MTP modules ``parts`` into ``path`` as GLM ships its MTP layer: ``mtp.safetensors``
    in the shard index, the layer's copies of the embedding and LM head beside it, and one MTP
    layer named in config.json."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    state = {}
    with torch.no_grad():
        for name, module in parts.items():
            for key, p in [*module.named_parameters(), *module.named_buffers()]:
                stem = f"model.layers.{n}." + ("" if name == "layer" else
                                               {"norm": "shared_head.norm.", "eh_proj": "eh_proj.",
                                                "enorm": "enorm.", "hnorm": "hnorm."}[name])
                if name == "layer" and key == "mlp.experts.gate_up_proj":
                    i = p.shape[1] // 2
                    for e in range(p.shape[0]):
                        state[f"{stem}mlp.experts.{e}.gate_proj.weight"] = p[e, :i].clone()
                        state[f"{stem}mlp.experts.{e}.up_proj.weight"] = p[e, i:].clone()
                elif name == "layer" and key == "mlp.experts.down_proj":
                    for e in range(p.shape[0]):
                        state[f"{stem}mlp.experts.{e}.down_proj.weight"] = p[e].clone()
                else:
                    state[stem + key] = p.detach().clone()
    ref = load_reference(path)
    state[f"model.layers.{n}.embed_tokens.weight"] = ref.model.embed_tokens.weight.detach().clone()
    state[f"model.layers.{n}.shared_head.head.weight"] = ref.lm_head.weight.detach().clone()
    save_file(state, path / "mtp.safetensors")
    with safe_open(path / "model.safetensors", "pt") as f:
        weight_map = {k: "model.safetensors" for k in f.keys()}
    weight_map.update({k: "mtp.safetensors" for k in state})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))



@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("glm-mtp"), "glm4_moe")
    return path, glm_mtp_parts(path)


def glm_join(mtp: dict, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """GLM's MTP input as vLLM builds it: the embedding at position 0 zeroed, then each normed
    (``enorm``, ``hnorm``) and joined by ``eh_proj``."""
    embedded = torch.cat([torch.zeros_like(embedded[:1]), embedded[1:]])
    return mtp["eh_proj"](torch.cat([mtp["enorm"](embedded), mtp["hnorm"](hidden)], -1))


def drafts_are_the_references(path, mtp: dict, monkeypatch, prompts, **options) -> None:
    """The engine's MTP drafts (3 a step, none shortened) for each of ``prompts``: the plain
    decode's tokens, at least 10 drafts, each the reference modules' ``mtp`` drafts."""
    monkeypatch.setattr(DraftLength, "update", lambda self, drafted, kept: None)
    seen = spy_drafts(monkeypatch)
    plain = LLM(path)
    llm = LLM(path, speculative_tokens=3, speculative_method="mtp", **options)
    ref = load_reference(path)
    for prompt in prompts:
        seen.clear()
        out = llm.generate(prompt, GREEDY)
        assert out.token_ids == plain.generate(prompt, GREEDY).token_ids
        assert len(seen) >= 10
        tokens = prompt + out.token_ids
        for computed, draft in seen:
            assert draft == reference_drafts(ref, mtp, tokens[:computed + 1], len(draft), glm_join), computed


def test_the_engines_glm_mtp_drafts_are_the_reference_drafts_and_change_no_token(glm_mtp, monkeypatch):
    path, mtp = glm_mtp
    drafts_are_the_references(path, mtp, monkeypatch, PROMPTS[:2])
    plain = LLM(path)
    seeded = LLM(path, speculative_tokens=4, speculative_method="mtp", prefill_chunk=5)
    for prompt in PROMPTS:
        out = seeded.generate(prompt, SAMPLED)
        assert out.token_ids == plain.generate(prompt, SAMPLED).token_ids and out.stats["draft_tokens"] > 0


def test_a_packed_glm_folder_carries_its_mtp_layer(glm_mtp, tmp_path):
    path, _ = glm_mtp
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(path),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    params = dict(speculative_tokens=3, speculative_method="mtp")
    want = LLM(path, **params)
    got = LLM(out, expert_cache_experts=5, cpu_expert_fraction=0.5, **params)
    for prompt in PROMPTS[:2]:
        a, b = want.generate(prompt, GREEDY), got.generate(prompt, GREEDY)
        assert a.token_ids == b.token_ids and a.stats["draft_tokens_kept"] == b.stats["draft_tokens_kept"]
    assert LLM(out).generate(PROMPTS[0], GREEDY).token_ids == want.generate(PROMPTS[0], GREEDY).token_ids


def test_a_glm_head_that_predicts_the_model_gets_its_drafts_kept(tmp_path):
    """The GLM layer fitted to the model's own greedy text (row i: hidden i and token i + 1,
    zero at position 0, predicting token i + 2), written back as GLM ships it: the engine keeps
    most of its drafts, so the mapping carries a trained head's skill, not only its shapes."""
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    path = make_tiny_checkpoint(tmp_path / "glm", "glm4_moe")
    mtp = glm_mtp_parts(path)
    base = LLM(path)
    texts = [p + base.generate(p, params).token_ids for p in PROMPTS]
    ref = load_reference(path)
    for p in ref.parameters():
        p.requires_grad_(False)
    train_head(ref, mtp, texts, join=glm_join)
    save_glm_mtp(path, mtp)
    outs = plain_outputs(LLM(path, speculative_tokens=4, speculative_method="mtp"), texts, params)
    kept, drafted = total(outs, "draft_tokens_kept"), total(outs, "draft_tokens")
    assert kept >= 0.35 * drafted, (kept, drafted)
