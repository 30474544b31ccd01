"""OpenAI's gpt-oss (``gpt_oss``): experts with biases and the clamped activation, a router with a
bias, MXFP4 experts as published. Parity with transformers on a random checkpoint (sinks, sliding
layers, yarn) is in test_parity.py and the other every-family suites; here the expert math against
transformers' own module, the published MXFP4 form, the published config and the refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.kernels import cpu_experts
from freetoken_engine.kernels.reference import GatedAct, expert_pairs_act, expert_pairs_forward
from freetoken_engine.models import family
from freetoken_engine.models.loader import dequantize_mxfp4
from freetoken_engine.packed import convert
from test_parity import PROMPT, check
from tiny_models import copy_folder, edited_config

LIMIT = 0.8


def _hf_experts(e: int = 6, h: int = 32, i: int = 24, seed: int = 0) -> GptOssExperts:
    torch.manual_seed(seed)
    experts = GptOssExperts(GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, swiglu_limit=LIMIT))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape))
    return experts


def _engine_layout(experts: GptOssExperts):
    """transformers' [E, H, 2I] interleaved pair and biases -> the engine's w13 [E, 2I, H] (gate
    rows, then up rows), b13 [E, 2I] likewise, w2 [E, H, I], b2 [E, H]."""
    gate_up, b = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat((gate_up[:, :, 0::2], gate_up[:, :, 1::2]), dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)
    return w13, experts.down_proj.detach().transpose(1, 2).contiguous(), b13, experts.down_proj_bias.detach()


@pytest.mark.parametrize("fn", [expert_pairs_forward, cpu_experts.experts_forward])
def test_expert_pairs_with_biases_and_clamps_match_transformers(fn):
    """Each (token, expert) pair's output plus the down bias is transformers' expert output, with
    the clamps biting (limit 0.8 on unit-scale rows); the pair's bias row follows ``pair_bias``
    where the weights' index is a cache slot (here the experts stored in reverse order)."""
    hf = _hf_experts()
    w13, w2, b13, b2 = _engine_layout(hf)
    act = GatedAct("swiglu_oai", 1.702, LIMIT)
    x = torch.randn(5, 32)
    tok = torch.tensor([0, 0, 1, 2, 3, 3, 4, 4])
    exp = torch.tensor([5, 1, 1, 0, 2, 5, 3, 4])
    with torch.no_grad():
        want = torch.stack([hf._apply_gate(x[t] @ hf.gate_up_proj[e] + hf.gate_up_proj_bias[e]) @ hf.down_proj[e]
                            + hf.down_proj_bias[e] for t, e in zip(tok.tolist(), exp.tolist())])
        h = x @ hf.gate_up_proj[0]
        assert (h.abs() > LIMIT).float().mean() > 0.5          # the clamps change most rows
    got = fn(x, w13, w2, tok, exp, act=act, b13=b13) + b2[exp]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    slots = 5 - exp                                           # slot s holds expert 5 - s
    got = fn(x, w13.flip(0), w2.flip(0), tok, slots, act=act, b13=b13, pair_bias=exp) + b2[exp]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    acts = expert_pairs_act(x, w13.flip(0), tok, slots, act=act, b13=b13, pair_bias=exp)   # the first stage
    with torch.no_grad():
        want_acts = torch.stack([hf._apply_gate(x[t] @ hf.gate_up_proj[e] + hf.gate_up_proj_bias[e])
                                 for t, e in zip(tok.tolist(), exp.tolist())])
    torch.testing.assert_close(acts, want_acts, rtol=1e-5, atol=1e-5)
    # the plain activation is not this one: the bias and the clamps are what the rows show
    assert (fn(x, w13, w2, tok, exp) + b2[exp] - want).abs().max() > 0.1


def test_mxfp4_dequantization_matches_transformers():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 10, 4), dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
    assert got.shape == (3, 10, 128) and torch.equal(got, want)
    with pytest.raises(ConfigError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], scales, torch.bfloat16)


def _as_mxfp4(src, dst):
    """``src``'s checkpoint with its experts replaced by random MXFP4 ones, as gpt-oss is published
    (``*_blocks`` / ``*_scales``, quant_method mxfp4), and a float32 copy of the same weights (the
    reference's). Returns (mxfp4 folder, float folder)."""
    mx, flat = copy_folder(src, dst / "mxfp4"), copy_folder(src, dst / "float")
    state = load_file(src / "model.safetensors")
    packed, dense = dict(state), dict(state)
    torch.manual_seed(1)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows = state[key].shape[0], state[key].shape[2]          # stored [E, in, out]
        blocks = torch.randint(0, 256, (e, rows, state[key].shape[1] // 32, 16), dtype=torch.uint8)
        scales = torch.randint(121, 126, blocks.shape[:-1], dtype=torch.uint8)
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(packed, mx / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, flat / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    cfg["dtype"] = "float32"
    (mx / "config.json").write_text(json.dumps(cfg))
    return mx, flat


def test_published_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(tiny_checkpoint, tmp_path):
    """gpt-oss as published: MXFP4 experts [E, 2I, H/32, 16] (not transposed, unlike transformers'
    float save), read, dequantized and deinterleaved into the bank; transformers on the same
    weights dequantized gives the same logits and tokens; a packed folder and the expert cache too."""
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, flat = _as_mxfp4(src, tmp_path)
    want = check(mx, n_new=16, ref_folder=flat)
    assert check(convert(mx, tmp_path / "packed", progress=False), n_new=16, ref_folder=flat) == want
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    for capacity, fraction in ((1, 0.0), (3, 0.5), (5, 1.0)):
        got = LLM(mx, expert_cache_experts=capacity, cpu_expert_fraction=fraction).generate(PROMPT, greedy)
        assert got.token_ids == want
        assert got.stats["fills"] + got.stats["cpu_computed"] == got.stats["misses"] > 0


def test_published_config_form(tiny_checkpoint, tmp_path):
    """The published config.json: ``experts_per_token``, a flat ``rope_scaling`` with ``rope_theta``
    beside it, no ``layer_types`` (sliding first, then alternating), no ``swiglu_alpha``."""
    def published(cfg):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        cfg["experts_per_token"] = cfg.pop("num_experts_per_tok")
        del cfg["layer_types"], cfg["swiglu_alpha"]
    folder = edited_config(tiny_checkpoint("gpt_oss"), tmp_path / "published", published)
    m = family("gpt_oss").parse(json.loads((folder / "config.json").read_text()))
    assert m.moe.top_k == 2 and m.sliding_window == (4, None) and m.rope.type == "yarn" and not m.rope.truncate
    assert m.moe.activation == "swiglu_oai" and m.moe.swiglu_alpha == 1.702 and m.moe.swiglu_limit == 1.0
    check(folder, n_new=8, ref_folder=tiny_checkpoint("gpt_oss"))


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(swiglu_limit=0), "swiglu_limit must be > 0"),
    (lambda c: c.update(quantization_config={"quant_method": "mxfp8"}), "'mxfp8'.*MXFP4 ones"),
    (lambda c: c.update(layer_types=["sliding_attention"]), "layer_types must name each of the 2 layers"),
])
def test_bad_configs_are_refused_with_what_to_fix(tiny_checkpoint, tmp_path, change, message):
    folder = edited_config(tiny_checkpoint("gpt_oss"), tmp_path / "bad", change)
    with pytest.raises(ConfigError, match=message):
        LLM(folder)


def test_the_tiny_model_has_its_parts_where_they_matter(tiny_checkpoint):
    """The parity suites mean something for the biases: each of the router's, the gate/up and
    the down biases, and the clamp limit, changed, moves the logits."""
    llm = LLM(tiny_checkpoint("gpt_oss"))
    base = llm.prefill_logits(PROMPT)
    block = llm.runner.model.model.layers[0].mlp
    for param in (block.gate.bias, block.expert_b13, block.expert_b2):
        keep = param.detach().clone()
        with torch.no_grad():
            param.mul_(-1)
        moved = (llm.prefill_logits(PROMPT) - base).abs().max()
        with torch.no_grad():
            param.copy_(keep)
        assert moved > 1e-3


def test_bfloat16_tokens_do_not_depend_on_the_cache_or_the_cpu_share(tiny_checkpoint):
    """In bfloat16 the compiled CPU kernel computes the gated experts on both sides of the split
    (the cache's slots and the bank), so any capacity and CPU fraction gives the all-resident
    model's tokens; its logits stay near float32's."""
    folder = tiny_checkpoint("gpt_oss")
    greedy = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    full = LLM(folder, dtype="bfloat16")
    want = full.generate(PROMPT, greedy).token_ids
    wide = (full.prefill_logits(PROMPT).float() - LLM(folder).prefill_logits(PROMPT)).abs().max()
    assert wide < 0.1
    for capacity, fraction in ((1, 0.0), (3, 0.5), (5, 1.0)):
        got = LLM(folder, dtype="bfloat16", expert_cache_experts=capacity, cpu_expert_fraction=fraction)
        out = got.generate(PROMPT, greedy)
        assert out.token_ids == want and out.stats["misses"] > 0
