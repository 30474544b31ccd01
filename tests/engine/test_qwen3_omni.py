"""Qwen3-Omni-MoE (``qwen3_omni_moe``) served as text: the thinker's language model under
``thinker.model`` with its own ``thinker.lm_head``, the audio and vision towers and the talker
left unread. The checkpoint is a random thinker made by transformers (its audio and vision towers
small), published as Qwen3-Omni is (every tensor under ``thinker.``, a talker beside it); the
engine gives the thinker's own tokens and logits on text."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from test_parity import PROMPT

TEXT = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "interleaved": True})
AUDIO = dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8, output_dim=32,
             n_window=2, n_window_infer=4, conv_chunksize=4, downsample_hidden_size=8)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16, deepstack_visual_indexes=[0])


@pytest.fixture(scope="module")
def omni(tiny_checkpoint, tmp_path_factory):
    """(the thinker alone, as transformers saves it; the same weights published as Qwen3-Omni)."""
    import transformers as T
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    torch.manual_seed(0)
    text = dict(TEXT, eos_token_id=json.loads((tiny_checkpoint() / "config.json").read_text())["eos_token_id"])
    cfg = Qwen3OmniMoeThinkerConfig(text_config=text, audio_config=AUDIO, vision_config=VISION)
    root = tmp_path_factory.mktemp("omni")
    thinker = root / "thinker"
    T.Qwen3OmniMoeThinkerForConditionalGeneration(cfg).save_pretrained(thinker)
    published = root / "published"
    published.mkdir()
    for f in tiny_checkpoint().iterdir():                     # the tokenizer and its template
        if f.name.startswith("tokenizer"):
            shutil.copy(f, published / f.name)
    tensors = {f"thinker.{k}": v for k, v in load_file(thinker / "model.safetensors").items()}
    tensors["talker.model.embed_tokens.weight"] = torch.zeros(4, 8)            # never read
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    (published / "config.json").write_text(json.dumps({
        "model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "thinker_config": json.loads((thinker / "config.json").read_text()), "talker_config": {"num_hidden_layers": 1},
        "enable_audio_output": False}))
    return thinker, published


def thinker_greedy(thinker, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The thinker's logits of ``ids`` and its ``n`` greedy tokens after them, on text alone."""
    import transformers as T
    ref = T.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(thinker, dtype=torch.float32).eval()
    with torch.no_grad():
        first = ref(input_ids=torch.tensor([ids])).logits[0]
        seq = list(ids)
        for _ in range(n):
            seq.append(int(ref(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return first, seq[len(ids):]


def test_the_thinker_runs_as_text_with_its_own_tokens(omni):
    thinker, published = omni
    want_logits, want = thinker_greedy(thinker, PROMPT, 12)
    llm = LLM(published, dtype="float32")
    assert (llm.prefill_logits(PROMPT) - want_logits).abs().max() < 1e-4
    assert (llm.forward_logits(PROMPT) - want_logits).abs().max() < 1e-4
    assert llm.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)).token_ids == want
    # its own output projection, not the embeddings: the two differ in this checkpoint
    emb = load_file(published / "model.safetensors")
    assert not torch.equal(emb["thinker.lm_head.weight"], emb["thinker.model.embed_tokens.weight"])


def test_a_packed_folder_and_the_expert_cache_give_the_same_tokens(omni, tmp_path):
    from freetoken_engine.packed import convert
    _, published = omni
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(published).generate(PROMPT, greedy).token_ids
    assert LLM(convert(published, tmp_path / "packed", progress=False)).generate(PROMPT, greedy).token_ids == want
    got = LLM(published, expert_cache_experts=3, cpu_expert_fraction=0.5).generate(PROMPT, greedy)
    assert got.token_ids == want and got.stats["misses"] > 0


def test_a_config_without_its_thinker_is_refused(omni, tmp_path):
    _, published = omni
    folder = tmp_path / "o"
    shutil.copytree(published, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["thinker_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="lacks thinker_config"):
        LLM(folder)
