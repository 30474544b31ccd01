"""Checkpoints whose routed experts are stored as two stacked tensors a layer
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``): the form transformers 5
holds them in and Qwen3.5/3.6-MoE are published in. Loaded, converted to the packed format and
refused when they do not fit, against the same weights stored one tensor per expert."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from test_parity import reference_greedy
from tiny_models import load_reference

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 7, 150]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fused_copy(src: Path, dst: Path, *, prefix: str = "", config=None, extra=None, drop_down=False,
               keep: int | None = None) -> Path:
    """``src``'s tensors with each layer's experts stacked into the fused pair (keys renamed with
    ``model.`` -> ``prefix`` when given), its other files copied; ``config`` replaces config.json;
    ``keep``: stack only that many experts; ``drop_down``: leave the down projections out."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    plain, experts = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for k, t in load_file(f).items():
            m = _EXPERT.match(k)
            if m:
                experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
            else:
                plain[k] = t
    for stem, parts in experts.items():
        n = len(parts["gate"]) if keep is None else keep
        plain[f"{stem}.gate_up_proj"] = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)])
        if not drop_down:
            plain[f"{stem}.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    if prefix:
        plain = {(prefix + k[len("model."):] if k.startswith("model.") else k): t for k, t in plain.items()}
    plain.update(extra or {})
    save_file({k: t.contiguous() for k, t in plain.items()}, dst / "model.safetensors")
    return dst


def multimodal_config(src: Path) -> dict:
    text = json.loads((src / "config.json").read_text())
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text, "vision_config": {"depth": 1}}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text", "qwen2_moe", "glm4_moe"])
def test_fused_experts_match_transformers(tmp_path, tiny_checkpoint, model_type):
    """The same weights, stacked: logits within 1e-4 and greedy tokens equal to transformers
    reading the per-expert original."""
    src = tiny_checkpoint(model_type)
    fused = fused_copy(src, tmp_path / "fused")
    ref = load_reference(src)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(fused)
    assert (llm.prefill_logits(PROMPT) - want).abs().max() < 1e-4
    assert llm.generate(PROMPT, GREEDY).token_ids == reference_greedy(ref, PROMPT, GREEDY.max_new_tokens)


def test_qwen36_as_published_loads_and_converts(tmp_path, tiny_checkpoint):
    """Qwen3.6-35B-A3B's layout: the multimodal config, the language model under
    ``model.language_model`` with fused experts, a vision tower and multi-token-prediction
    tensors beside it (neither read). Served directly and after ``freetoken convert``, it answers
    as the per-expert text checkpoint does."""
    src = tiny_checkpoint("qwen3_5_moe_text")
    extra = {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3),
             "mtp.fc.weight": torch.zeros(8, 8)}
    vl = fused_copy(src, tmp_path / "vl", prefix="model.language_model.", config=multimodal_config(src),
                    extra=extra)
    want = LLM(src).generate(PROMPT, GREEDY).token_ids
    assert LLM(vl).generate(PROMPT, GREEDY).token_ids == want
    out = tmp_path / "packed"
    done = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(vl),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert LLM(out).generate(PROMPT, GREEDY).token_ids == want


def test_fused_experts_that_do_not_fit_are_refused_clearly(tmp_path, tiny_checkpoint):
    src = tiny_checkpoint("qwen3_moe")
    experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    lacking = fused_copy(src, tmp_path / "no-down", drop_down=True)
    with pytest.raises(ConfigError, match=r"experts\.gate_up_proj but lacks .*experts\.down_proj"):
        LLM(lacking)
    wrong = fused_copy(src, tmp_path / "wrong-count", keep=experts - 2)
    with pytest.raises(ConfigError, match=rf"holds {experts - 2} experts .*config\.json says {experts}"):
        LLM(wrong)
    done = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(lacking),
                           "--out", str(tmp_path / "packed")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "lacks" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "packed").exists()
