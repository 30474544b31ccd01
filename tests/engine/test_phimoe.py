"""Phi-3.5-MoE (``phimoe``): sparsemixer routing, the longrope rotary, LayerNorms with biases and
an LM head with one. Parity with transformers on a random checkpoint (with all of them) is in
test_parity.py and the other every-family suites; here each part against transformers' own
function, the published config's form, and the refusals."""
from __future__ import annotations


import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.config import RopeConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.layers.moe import sparsemixer
from freetoken_engine.layers.norm import LayerNorm
from freetoken_engine.layers.rope import Rotary
from freetoken_engine.models import family
from test_parity import PROMPT, check, packed_and_cached
from tiny_models import copy_folder, edited_config, uneven_norms

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.2, 1.0])
def test_sparsemixer_matches_transformers_and_keeps_near_experts_in_the_softmax(eps):
    torch.manual_seed(0)
    # near ties, negative best logits, one clear winner: each decides the mask differently
    logits = torch.cat((torch.randn(64, 16), -torch.rand(16, 16) - 0.5, torch.randn(16, 16) * 0.01 + 3.0))
    weights, ids = sparsemixer(logits, eps)
    want_w, want_ids = hf_sparsemixer(logits, jitter_eps=eps, training=False)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=1e-7)
    assert (ids[:, 0] != ids[:, 1]).all() and torch.equal(ids[:, 0], logits.argmax(-1))
    shared = (weights[:, 0] < 1 - 1e-6).sum()          # rows whose first expert shared its softmax
    assert (shared == 0) if eps == 0.0 else (shared > 0)


def test_the_tiny_model_routes_with_shared_softmaxes(tiny_checkpoint):
    """The parity suites mean something for the masking: the random model's routers leave several
    experts in the first softmax at some positions (weight below 1) and one alone at others."""
    from freetoken_engine.layers import moe as M
    llm = LLM(tiny_checkpoint("phimoe"))
    firsts, real = [], M.sparsemixer

    def seen(logits, eps):
        w, ids = real(logits, eps)
        firsts.append(w[:, 0])
        return w, ids
    M.sparsemixer = seen
    try:
        llm.prefill_logits(PROMPT)
    finally:
        M.sparsemixer = real
    w = torch.cat(firsts)
    assert (w < 0.999).any() and (w > 0.999).any()


def _hf_rope(params: dict, seq_len: int | None):
    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                     original_max_position_embeddings=64, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)


LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64,
                short_factor=[1.0, 1.1, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
                long_factor=[1.0, 1.4, 2.0, 3.5, 6.0, 9.0, 12.0, 16.0])


@pytest.mark.parametrize("mscales", [dict(short_mscale=1.1, long_mscale=1.3), {}])
def test_longrope_rotates_short_then_long_as_transformers_computes_each(mscales):
    params = dict(LONGROPE, **mscales)
    rope = RopeConfig.from_hf(dict(rope_parameters=params, max_position_embeddings=512))
    rotary = Rotary(rope, 16, 512, torch.device("cpu"))
    cos, _ = rotary.cos_sin(torch.arange(128), torch.float32)
    for positions, seq_len, scale in ((torch.arange(64), None, "short_mscale"),
                                      (torch.arange(64, 128), 65, "long_mscale")):
        inv, factor = _hf_rope(params, seq_len)             # attention factor: sqrt(1 + ln 8 / ln 64)
        freqs = positions.float()[:, None] * inv[None, :]
        want = torch.cat((freqs, freqs), -1).cos() * mscales.get(scale, factor)
        torch.testing.assert_close(cos[positions, 0], want, rtol=0, atol=1e-6)


def test_a_published_phi35_moe_config_reads_as_its_parts():
    raw = {"model_type": "phimoe", "vocab_size": 32064, "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 6400, "num_local_experts": 16,
           "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "attention_bias": True, "lm_head_bias": True,
           "router_jitter_noise": 0.01, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
           "rope_theta": 10000.0, "sliding_window": 131072,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
                            "short_mscale": 1.243163121016122, "long_mscale": 1.243163121016122}}
    cfg = family("phimoe").parse(raw)
    assert cfg.layer_norm and cfg.lm_head_bias and cfg.qkv_bias and cfg.o_bias
    assert (cfg.moe.scoring, cfg.moe.jitter_eps, cfg.moe.top_k, cfg.moe.num_experts) == ("sparsemixer", 0.01, 2, 16)
    assert (cfg.rope.type, cfg.rope.original_max_position, cfg.rope.short_mscale) == ("longrope", 4096, 1.243163121016122)
    assert cfg.rope.factor == 32.0 and len(cfg.rope.long_factor) == 64


@pytest.mark.parametrize("change,needle", [
    (lambda p: p.pop("long_factor"), "needs long_factor"),
    (lambda p: p.update(short_factor=[1.0, 2.0]), "one length"),
    (lambda p: p.update(short_factor=[1.0, 0.0, 1.0, 1.0], long_factor=[1.0] * 4), "positive numbers"),
    (lambda p: p.update(short_factor=[1.0] * 3, long_factor=[1.0] * 3), "name 3 frequencies; the rotary has 4"),
])
def test_a_broken_longrope_fails_with_what_to_fix(tiny_checkpoint, tmp_path, change, needle):
    folder = edited_config(tiny_checkpoint("phimoe"), tmp_path / "p", lambda cfg: change(cfg["rope_parameters"]))
    with pytest.raises(ConfigError, match=needle):
        LLM(folder)


def test_sparsemixer_needs_two_experts_a_token():
    raw = {"model_type": "phimoe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 3}
    with pytest.raises(ConfigError, match="sparsemixer routing picks 2 experts; num_experts_per_tok is 3"):
        family("phimoe").parse(raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_adds_then_norms_as_torch_does(dtype):
    torch.manual_seed(0)
    norm = LayerNorm(48, 1e-5).to(dtype)
    ref = torch.nn.LayerNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        for p in (norm.weight, norm.bias):
            p.copy_(torch.randn(48))
        ref.load_state_dict(norm.state_dict())
        x, residual = torch.randn(5, 48, dtype=dtype), torch.randn(5, 48, dtype=dtype) * 4 + 2
        s, y = norm.add_forward(x, residual)
        assert torch.equal(s, residual + x) and torch.equal(y, ref(residual + x))


def test_the_lm_head_bias_counts(tiny_checkpoint, tmp_path):
    """A checkpoint whose LM-head bias favours one token makes the engine say it: the bias is read."""
    from safetensors.torch import load_file, save_file
    folder = copy_folder(tiny_checkpoint("phimoe"), tmp_path / "p")
    state = load_file(folder / "model.safetensors")
    state["lm_head.bias"] = torch.zeros_like(state["lm_head.bias"])
    state["lm_head.bias"][77] = 1e4
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    assert set(LLM(folder).generate(PROMPT, GREEDY).token_ids) == {77}


def test_every_bias_and_norm_is_read_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """transformers starts every bias at zero and every norm weight at one; random ones here, so a
    bias left unread, or read into another's place, shows (LayerNorms, q/k/v/o, the LM head)."""
    folder = uneven_norms(copy_folder(tiny_checkpoint("phimoe"), tmp_path / "p"),
                          ("norm.weight", "norm.bias", "proj.bias", "lm_head.bias"))
    check(folder)


def test_a_packed_folder_and_the_expert_cache_give_the_same_tokens(tiny_checkpoint, tmp_path):
    src = uneven_norms(copy_folder(tiny_checkpoint("phimoe"), tmp_path / "p"), ("norm.bias", "proj.bias"))
    packed_and_cached(src, tmp_path / "packed")


def test_the_long_factors_rotate_from_the_original_context_on_and_only_there(tiny_checkpoint, tmp_path):
    """Positions from ``original_max_position_embeddings`` (256 here) on rotate by the long factors,
    earlier ones by the short: a 200-token prompt ignores the long factors, a 300-token one does
    not, and its whole-prompt logits equal its token-by-token ones (a token's rotation is its
    position's, so the KV written before the boundary stays valid after it)."""
    folder = copy_folder(tiny_checkpoint("phimoe"), tmp_path / "p")
    ids = [(7 * i) % 300 + 3 for i in range(300)]
    llm = LLM(folder, max_context=512)
    short, long = llm.prefill_logits(ids[:200]), llm.prefill_logits(ids)
    assert (llm.forward_logits(ids) - long).abs().max() < 1e-4
    other = LLM(edited_config(folder, tmp_path / "q", lambda cfg: cfg["rope_parameters"].update(
        long_factor=[3.0, 5.0, 9.0, 20.0])), max_context=512)
    assert torch.equal(other.prefill_logits(ids[:200]), short)
    assert (other.prefill_logits(ids) - long).abs().max() > 1e-2
