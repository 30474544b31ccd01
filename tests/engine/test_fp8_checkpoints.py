"""FP8 checkpoints as Qwen, GLM and DeepSeek publish them (e4m3 weights, a float32
``weight_scale_inv`` per block, ``quantization_config`` ``fp8``) and as llm-compressor makes its
"FP8-dynamic" ones (``compressed-tensors``: ``weight_scale`` per output channel, an unread
``input_scale``): dequantized as they are read, they give transformers' tokens on the same
dequantized weights, per-expert and stacked, directly and through ``freetoken convert``. Other
quantizations and FP8 tensors without their scales are refused in one line."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.packed.format import INDEX_NAME
from test_fused_experts import fused_copy
from test_parity import PROMPT, check
from tiny_models import copy_folder

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
BLOCK = (16, 16)          # 128 x 128 in the published checkpoints; small here so that blocks are partial
# the projections FP8 checkpoints quantize: attention, dense MLPs and experts (not routers, norms,
# embeddings or the LM head)
QUANTIZED = re.compile(r"\.(self_attn\.([qkvo]_proj|q_[ab]_proj|kv_a_proj_with_mqa|kv_b_proj)|mlp\.(experts\.\d+\.)?(gate|up|down)_proj"
                       r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$|\.mlp\.experts\.(gate_up|down)_proj$")


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales per ``block`` of its last two dimensions), as the FP8
    checkpoints are made: each block's largest magnitude maps to e4m3's largest, 448."""
    n, k = w.shape[-2:]
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*w.shape[:-2], rows * bn, cols * bk)
    padded[..., :n, :k] = w
    blocks = padded.reshape(*w.shape[:-2], rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0             # [..., rows, cols]
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale


COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}


def fp8_pair(src, fp8_dir, ref_dir, compressed: bool = False):
    """``src`` quantized into ``fp8_dir`` (FP8 weights, scales, quantization_config; with
    ``compressed``, llm-compressor's layout: a scale per output channel and a static input scale),
    and the same dequantized weights in ``ref_dir`` for transformers."""
    for d in (fp8_dir, ref_dir):
        copy_folder(src, d)
    state = load_file(src / "model.safetensors")
    fp8, ref = {}, {}
    for k, t in state.items():
        if QUANTIZED.search(k):
            block = (1, t.shape[-1]) if compressed else BLOCK
            q, scale = quantize(t.float(), block)
            fp8[k] = q
            if compressed:
                fp8[k + "_scale"], fp8[k.replace(".weight", ".input_scale")] = scale, torch.tensor([0.02])
            else:
                fp8[k + "_scale_inv"] = scale
            full = scale.repeat_interleave(block[0], -2)[..., :t.shape[-2], :]
            ref[k] = q.float() * full.repeat_interleave(block[1], -1)[..., :t.shape[-1]]
        else:
            fp8[k] = ref[k] = t
    save_file(fp8, fp8_dir / "model.safetensors")
    save_file(ref, ref_dir / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = COMPRESSED if compressed else {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    assert sum(t.dtype == torch.float8_e4m3fn for t in fp8.values()) > 10
    return fp8_dir, ref_dir


@pytest.mark.parametrize("model_type,compressed", [("qwen3_moe", False), ("glm4_moe", False), ("qwen3_moe", True),
                                                    ("deepseek_v3", False)],
                         ids=["qwen3_moe-blocks", "glm4_moe-blocks", "qwen3_moe-compressed-channels",
                              "deepseek_v3-blocks"])
def test_fp8_checkpoints_give_transformers_tokens_on_the_dequantized_weights(tiny_checkpoint, tmp_path, model_type,
                                                                               compressed):
    src = tiny_checkpoint(model_type, moe_intermediate_size=24)          # blocks of 16: partial ones too
    folder, ref_dir = fp8_pair(src, tmp_path / "fp8", tmp_path / "ref", compressed)
    tokens = check(folder, n_new=GREEDY.max_new_tokens, ref_folder=ref_dir)
    out = tmp_path / "packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert", "--model", str(folder),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    index = json.loads((out / INDEX_NAME).read_text())
    assert not [k for k in index["tensors"] if "_scale" in k]               # dequantized, scales left behind
    assert LLM(out, expert_cache_experts=3, cpu_expert_fraction=0.5).generate(PROMPT, GREEDY).token_ids == tokens


def test_stacked_fp8_experts_are_dequantized_per_expert_block(tiny_checkpoint, tmp_path):
    """Experts stacked into gate_up_proj [E, 2I, H] / down_proj [E, H, I] with scales per expert
    and block ([E, rows, cols])."""
    src = tiny_checkpoint("qwen3_moe", moe_intermediate_size=24)
    stacked = fused_copy(src, tmp_path / "stacked")
    folder, ref_dir = fp8_pair(stacked, tmp_path / "fp8", tmp_path / "ref")
    assert load_file(folder / "model.safetensors")["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].dim() == 3
    want = LLM(ref_dir).generate(PROMPT, GREEDY).token_ids
    assert LLM(folder).generate(PROMPT, GREEDY).token_ids == want


@pytest.mark.parametrize("change,says", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config 'awq'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt 'e5m2'"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int"}}}}}, "compressed-tensors weights of int4"),
])
def test_other_quantizations_are_refused_by_name(tiny_checkpoint, tmp_path, change, says):
    folder = copy_folder(tiny_checkpoint("qwen3_moe"), tmp_path / "q")
    cfg = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(folder),
                        "--prompt-ids", "1,2", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr


def test_an_fp8_tensor_without_its_scales_is_refused(tiny_checkpoint, tmp_path):
    folder, _ = fp8_pair(tiny_checkpoint("qwen3_moe"), tmp_path / "fp8", tmp_path / "ref")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ConfigError, match="q_proj.weight .* float8 without its scales"):
        LLM(folder)
