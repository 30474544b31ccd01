"""GGUF files of Qwen3-MoE as llama.cpp's converter writes them (``qwen3moe``: experts stacked per
layer in ``ffn_{gate,up,down}_exps``, q/k norms, Qwen's unpermuted Q/K rows), built here from a
random transformers checkpoint: transformers' own GGUF reader reads the file back into that
checkpoint (so the file is as llama.cpp would write it), the engine gives transformers' tokens on
it, float32 exactly and Q8_0 against transformers on the same file, and the folder it converts to
is written a layer at a time. A dense Qwen3 (``qwen3``) file and a Mixtral one (``llama`` with
experts) too."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.models.gguf import convert_gguf
from test_parity import PROMPT, check, reference_greedy
from test_cli import cli_error  # noqa: F401  (the fixture)
from tiny_models import copy_folder, load_reference

BLOCK = {"input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q",
         "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
         "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
         "self_attn.k_norm.weight": "attn_k_norm", "post_attention_layernorm.weight": "ffn_norm",
         "mlp.gate.weight": "ffn_gate_inp"}
MIXTRAL = {**{k: v for k, v in BLOCK.items() if "norm" not in k or "layernorm" in k},
           "block_sparse_moe.gate.weight": "ffn_gate_inp"}
del MIXTRAL["mlp.gate.weight"]
MINIMAX = {**{k: v for k, v in BLOCK.items() if k != "mlp.gate.weight"}, "block_sparse_moe.gate.weight": "ffn_gate_inp",
           "block_sparse_moe.e_score_correction_bias": "exp_probs_b"}
GLM = {**{k: v for k, v in BLOCK.items() if k != "post_attention_layernorm.weight"},
       "post_attention_layernorm.weight": "post_attention_norm", "mlp.gate.e_score_correction_bias": "exp_probs_b",
       "self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k", "self_attn.v_proj.bias": "attn_v",
       "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
       "mlp.shared_experts.down_proj.weight": "ffn_down_shexp"}
GLM_DENSE = {**{k: v for k, v in GLM.items() if ".gate." not in k and "shared" not in k},
             "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
QWEN2_MOE = {**{k: v for k, v in BLOCK.items() if "_norm." not in k},
             "self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k", "self_attn.v_proj.bias": "attn_v",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp"}
DENSE = {**{k: v for k, v in BLOCK.items() if k != "mlp.gate.weight"}, "mlp.gate_proj.weight": "ffn_gate",
         "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
QWEN2 = {**{k: v for k, v in DENSE.items() if "_norm." not in k},
         "self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k", "self_attn.v_proj.bias": "attn_v"}


def permute(t: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows in llama.cpp's order: within each head, the rotary halves interleaved."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def write_gguf(folder, out, quant: str = "F32"):
    """``folder`` (a transformers qwen3_moe or qwen3 checkpoint) as llama.cpp's converter writes it."""
    import gguf
    from gguf.quants import quantize
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    state = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    arch = {"qwen3_moe": "qwen3moe", "qwen3": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
            "minimax_m2": "minimax-m2", "glm4_moe": "glm4moe", "qwen2": "qwen2"}[cfg["model_type"]]
    moe = arch not in ("qwen3", "qwen2")
    w = gguf.GGUFWriter(str(out), arch=arch)
    nextn = 1 if arch == "glm4moe" else 0          # GLM's files hold an MTP block after the model's own
    w.add_block_count(cfg["num_hidden_layers"] + nextn)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if cfg.get("rotary_dim"):
        w.add_rope_dimension_count(cfg["rotary_dim"])
    if arch == "glm4moe":
        w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"].get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(nextn)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
    if moe:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size", cfg["intermediate_size"]))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {a["id"]: a for a in tok["added_tokens"]}
    tokens = [added[i]["content"] if i in added else t for t, i in vocab]
    tokens += [added[i]["content"] for i in sorted(added) if i >= len(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if added.get(i, {}).get("special") else 4 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg["eos_token_id"])
    kind = getattr(gguf.GGMLQuantizationType, quant)

    def add(name, arr, big=True):
        if big and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, quantize(arr, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, arr)
    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"], big=False)
    add("output.weight", state["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"] + nextn):
        if i == cfg["num_hidden_layers"]:               # the MTP block: a copy of the last layer's, and its own
            i, src_layer = cfg["num_hidden_layers"], cfg["num_hidden_layers"] - 1
            for g in ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"):
                add(f"blk.{i}.{g}.weight", np.ones((cfg["hidden_size"],) * (2 if "proj" in g else 1), np.float32))
        else:
            src_layer = i
        stem = f"model.layers.{src_layer}."
        dense = arch == "glm4moe" and src_layer < cfg["first_k_dense_replace"]
        block = {"qwen3": DENSE, "qwen2": QWEN2, "llama": MIXTRAL, "qwen2moe": QWEN2_MOE, "minimax-m2": MINIMAX,
                 "glm4moe": GLM_DENSE if dense else GLM}.get(arch, BLOCK)
        for hf, g in block.items():
            t = state[stem + hf]
            if arch == "llama" and g in ("attn_q", "attn_k"):     # llama.cpp's rotary row order
                t = permute(t, cfg["num_attention_heads"] if g == "attn_q" else cfg["num_key_value_heads"])
            if g == "ffn_gate_inp_shexp":                          # [1, H] -> [H], as llama.cpp stores it
                t = t.reshape(-1)
            suffix = "weight" if hf.endswith(".weight") else "bias"          # exp_probs_b is a bias too
            add(f"blk.{i}.{g}.{suffix}", t, big=hf.endswith("proj.weight"))
        if not moe or dense:
            continue
        mixtral = arch in ("llama", "minimax-m2")
        names = (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")) if mixtral else \
            (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps"))
        moe_block = "block_sparse_moe" if mixtral else "mlp"
        for proj, g in names:
            add(f"blk.{i}.{g}.weight", np.stack([state[f"{stem}{moe_block}.experts.{e}.{proj}.weight"]
                                                 for e in range(experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gguf_reference(path, src, cls=None):
    """transformers' model of the GGUF file ``path``: its GGUF reader's tensors (its own
    dequantization and names) in the architecture of ``src`` (``cls``, Qwen3-MoE's by default)."""
    from transformers import AutoConfig, Qwen3MoeForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cls = cls or Qwen3MoeForCausalLM
    with torch.device("meta"):
        skeleton = cls(AutoConfig.from_pretrained(src))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = cls(AutoConfig.from_pretrained(src)).eval()
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v).float() for k, v in tensors.items()},
                                                strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def reads_back_exactly(path, src, cls=None) -> None:
    """transformers' GGUF reader gives back every tensor of the checkpoint ``src`` the file at
    ``path`` was written from: the file is as llama.cpp writes it."""
    got = gguf_reference(path, src, cls).state_dict()
    want = load_reference(src).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def src(tiny_checkpoint):
    # sizes llama.cpp's Q8_0 blocks of 32 divide
    return tiny_checkpoint("qwen3_moe", moe_intermediate_size=32, hidden_size=64, head_dim=16)


def test_transformers_reads_the_file_back_into_the_checkpoint(src, tmp_path):
    """The file is as llama.cpp writes it: transformers' GGUF reader, which knows the format,
    gives back every tensor of the checkpoint it came from."""
    reads_back_exactly(write_gguf(src, tmp_path / "m.gguf"), src)


def test_a_float32_file_gives_transformers_tokens_exactly(src, tmp_path):
    folder = convert_gguf(write_gguf(src, tmp_path / "m.gguf"), tmp_path / "hf")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) == 3                         # a shard per layer, one for the rest
    check(folder, n_new=16, ref_folder=src)


def test_a_q8_0_file_gives_transformers_tokens_on_the_same_file(src, tmp_path):
    """Quantized experts and projections: the engine, loading the file by path as users do,
    against transformers loading the same file (its own dequantization)."""
    path = write_gguf(src, tmp_path / "q8.gguf", quant="Q8_0")
    ref = gguf_reference(path, src)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(path)
    assert (llm.prefill_logits(PROMPT) - want).abs().max() < 1e-4
    got = llm.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)).token_ids
    assert got == reference_greedy(ref, PROMPT, 16)


def test_a_dense_qwen3_file_gives_transformers_tokens(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3")
    check(convert_gguf(write_gguf(src, tmp_path / "d.gguf"), tmp_path / "hf"), n_new=16, ref_folder=src)


def test_a_mixtral_file_gives_transformers_tokens(tiny_checkpoint, tmp_path):
    """Mixtral as llama.cpp writes it: the llama architecture with ``llama.expert_count`` experts,
    its Q and K rows permuted for llama.cpp's rotary (which the engine undoes)."""
    src = tiny_checkpoint("mixtral")
    check(convert_gguf(write_gguf(src, tmp_path / "x.gguf"), tmp_path / "hf"), n_new=16, ref_folder=src)


QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
TRICKY = ["(hello) DON'T it's ,world\n\n\n  x", "price:$12345.67 [list] {dict}\r\nnext", "déjà-vu (hello) 🙂 DON'T"]


def test_a_qwen_files_tokenizer_splits_text_as_qwens_does(tiny_checkpoint, tmp_path):
    """Qwen's pre-tokenizer keeps a punctuation mark with the word after it ("(hello"), digits
    one by one, contractions in any case: a vocabulary trained that way, in a GGUF file that
    names it ``qwen2``, encodes every text as transformers' GGUF tokenizer does (GPT-2's split,
    which the engine used before, cannot make "(hello")."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from freetoken_engine.models.gguf import load_gguf
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRICKY * 50, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_end|>"],
                                                              show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    src = tiny_checkpoint("qwen3_moe", moe_intermediate_size=32, hidden_size=64, head_dim=16)
    folder = copy_folder(src, tmp_path / "src")
    tok.save(str(folder / "tokenizer.json"))
    assert "(hello" in tok.get_vocab()              # a token GPT-2's split cannot produce
    path = write_gguf(folder, tmp_path / "q.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    ours = Tokenizer.from_str(load_gguf(path).tokenizer_json)
    for text in TRICKY + ["(hello"]:
        assert ours.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False), text


def test_a_qwen2_moe_file_is_read_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """Qwen1.5-MoE / Qwen2-57B as llama.cpp writes them: q/k/v biases, a shared expert whose gate
    is stored as a vector; transformers' GGUF reader gives the checkpoint back, and the engine its
    tokens."""
    from transformers import Qwen2MoeForCausalLM
    src = tiny_checkpoint("qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=32)
    path = write_gguf(src, tmp_path / "q2.gguf")
    reads_back_exactly(path, src, Qwen2MoeForCausalLM)
    check(convert_gguf(path, tmp_path / "hf"), n_new=16, ref_folder=src)


def test_a_minimax_m2_file_is_read_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """MiniMax-M2 as llama.cpp writes it: its routing bias (``exp_probs_b``), q/k norms over the
    whole projection, rotary over part of each head (``rope.dimension_count``)."""
    from transformers import MiniMaxM2ForCausalLM
    src = tiny_checkpoint("minimax_m2", intermediate_size=32)
    path = write_gguf(src, tmp_path / "mm.gguf")
    reads_back_exactly(path, src, MiniMaxM2ForCausalLM)
    check(convert_gguf(path, tmp_path / "hf"), n_new=16, ref_folder=src)


def test_a_glm_4_5_file_gives_transformers_tokens(tiny_checkpoint, tmp_path):
    """GLM-4.5 as llama.cpp writes it (its conventions as llama.cpp's glm4-moe graph reads them:
    ``post_attention_norm`` before the MLP, the routing bias ``exp_probs_b``, ungated shared experts
    ``ffn_*_shexp``, a dense first block, rotary over ``rope.dimension_count`` of each head, the
    Q/K rows as they are, and an MTP block counted in ``block_count``), which transformers cannot
    read: the engine's tokens equal transformers' on the checkpoint the file was written from, the
    MTP block left unread."""
    src = tiny_checkpoint("glm4_moe", n_group=1, topk_group=1, moe_intermediate_size=32, intermediate_size=32)
    folder = convert_gguf(write_gguf(src, tmp_path / "glm.gguf"), tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["attention_bias"] and cfg["use_qk_norm"]
    check(folder, n_new=16, ref_folder=src)


def test_a_gguf_file_packs_and_serves_its_tokens(src, tmp_path):
    """``freetoken convert --model file.gguf``: the packed folder of the file's converted
    checkpoint, which serves the tokens the file does."""
    from freetoken_engine.packed import convert
    path = write_gguf(src, tmp_path / "m.gguf")
    out = convert(path, tmp_path / "packed", progress=False)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert LLM(out).generate(PROMPT, params).token_ids == LLM(path).generate(PROMPT, params).token_ids


def test_an_architecture_the_engine_cannot_read_is_refused_by_name(tmp_path, cli_error):  # noqa: F811
    """A DeepSeek-V3 file (MLA attention, not run here): one line that names what is supported."""
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "ds.gguf"), arch="deepseek2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    err = cli_error("generate", "--model", str(tmp_path / "ds.gguf"), "--prompt-ids", "1,2")
    assert "unsupported GGUF architecture 'deepseek2'" in err and "qwen3moe" in err and "glm4moe" in err


def test_a_qwen2_file_is_read_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """Qwen2/2.5 (dense, q/k/v biases): transformers' GGUF reader gives the checkpoint back, the
    engine its tokens."""
    from transformers import Qwen2ForCausalLM
    src = tiny_checkpoint("qwen2")
    path = write_gguf(src, tmp_path / "q2.gguf")
    reads_back_exactly(path, src, Qwen2ForCausalLM)
    check(convert_gguf(path, tmp_path / "hf"), n_new=16, ref_folder=src)
