"""The GGUF loader against transformers' own GGUF reader and its llama, on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch

from freetoken_engine.convert.source import smollm2_gguf_path
from freetoken_engine.models.gguf import GGUFError, load_gguf, write_hf_folder


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.fail(f"{exc} (CI installs it)")


@pytest.fixture(scope="module")
def model(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def dense_dir(model, tmp_path_factory):
    """The 135M model in float32 (0.5 GB), removed after this module: CI's disk may be small."""
    out = write_hf_folder(model, tmp_path_factory.mktemp("smollm2-dense"))
    yield out
    shutil.rmtree(out, ignore_errors=True)


def test_config_is_smollm2_135m(model):
    cfg = model.config
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in model.tensors
    assert cfg["rope_theta"] == 100000.0 and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2


def test_tensors_equal_transformers_gguf_reader(model, gguf_path, dense_dir):
    """transformers dequantizes and un-permutes Q/K on its own: every tensor must agree exactly."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(dense_dir))
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ref) == set(model.tensors)
    for key, value in ref.items():
        assert torch.equal(torch.as_tensor(value).float(), model.tensors[key]), key


def test_dense_folder_answers_in_transformers(dense_dir):
    """The written folder is a working HF checkpoint: greedy chat answer names Paris."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(dense_dir)
    lm = LlamaForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"]])
    out = lm.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_tokenizer_matches_transformers_gguf_tokenizer(dense_dir, gguf_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(str(dense_dir / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = ("In 1987 the 3 quick foxes paid $12,345.67 for déjà-vu 🙂.\n\t  def f(x):\n"
            "        return x**2  # indented <|im_start|>user\nhi<|im_end|>")
    ids = ours.encode(text).ids
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round trip
    assert ours.encode("<|im_start|><|im_end|>").ids == [1, 2]
    assert ours.encode("2024").ids == [ours.token_to_id(d) for d in "2024"]  # digits split


def test_chat_template_present(model, dense_dir):
    tcfg = json.loads((dense_dir / "tokenizer_config.json").read_text())
    assert tcfg["bos_token"] == "<|im_start|>" and tcfg["eos_token"] == "<|im_end|>"
    rendered = jinja2.Template(tcfg["chat_template"]).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in rendered
    gen = json.loads((dense_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_truncated_file_is_a_clear_error(gguf_path, tmp_path):
    bad = tmp_path / "broken.gguf"
    with open(gguf_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(1 << 20))  # header and metadata intact, tensor data cut off
    with pytest.raises(GGUFError):
        load_gguf(bad)
    with pytest.raises(GGUFError, match="not found"):
        load_gguf(tmp_path / "absent.gguf")


def test_non_gguf_file_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    shutil.copyfile(__file__, junk)
    with pytest.raises(GGUFError):
        load_gguf(junk)


def test_our_reader_gives_the_gguf_packages_fields_and_tensor_bytes(gguf_path):
    """models/gguf_file.py replaced gguf.GGUFReader (5.6 s of string views on this file): same
    metadata values and types, same tensor names, shapes, types and bytes."""
    import gguf
    from freetoken_engine.models.gguf_file import GGUFFile

    ours, ref = GGUFFile(gguf_path), gguf.GGUFReader(str(gguf_path))
    want = {k: f.contents() for k, f in ref.fields.items()}
    assert ours.metadata == want
    assert all(type(ours.metadata[k]) is type(v) for k, v in want.items())
    assert [(t.name, t.ne, t.qtype) for t in ours.tensors] == \
        [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.raw.dtype == b.data.dtype and a.raw.shape == b.data.shape and np.array_equal(a.raw, b.data), a.name


def test_every_value_type_reads_as_the_gguf_package_wrote_it(tmp_path):
    import gguf
    from freetoken_engine.models.gguf_file import GGUFFile

    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("u8", 200)
    w.add_int8("i8", -5)
    w.add_uint16("u16", 60000)
    w.add_int16("i16", -30000)
    w.add_uint32("u32", 4_000_000_000)
    w.add_int32("i32", -2_000_000_000)
    w.add_float32("f32", 0.1)
    w.add_uint64("u64", 1 << 60)
    w.add_int64("i64", -(1 << 60))
    w.add_float64("f64", 0.1)
    w.add_bool("yes", True)
    w.add_string("s", "naïve ✓")
    w.add_array("ints", [1, 2, 3])
    w.add_array("strs", ["a", "", "ü"])
    w.add_array("nested", [[1, 2], [3]])
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = GGUFFile(path).metadata
    want = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    # gguf's reader flattens a nested array (its contents() gives [1, 2, 3]); ours keeps the lists
    assert {k: v for k, v in got.items() if k != "nested"} == {k: v for k, v in want.items() if k != "nested"}
    assert got["f32"] == float(np.float32(0.1)) and got["nested"] == [[1, 2], [3]] and got["s"] == "naïve ✓"
    (t,) = GGUFFile(path).tensors
    assert t.name == "t" and t.ne == (32, 2) and np.array_equal(t.raw.reshape(2, 32), np.arange(64).reshape(2, 32))


@pytest.mark.parametrize("cut", [0, 3, 10, 30, 200, 1 << 16, -100])
def test_a_file_cut_anywhere_is_one_clear_error(gguf_path, tmp_path, cut):
    """Empty, inside the magic, the counts, the first key, the vocabulary, or the last tensor."""
    data = Path(gguf_path).read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated|not a GGUF|cannot read"):
        load_gguf(bad)


def test_an_unsupported_version_says_which(gguf_path, tmp_path):
    data = bytearray(Path(gguf_path).read_bytes()[:4096])
    data[4:8] = (3 << 24).to_bytes(4, "little")      # a big-endian version 3, read little-endian
    bad = tmp_path / "be.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="version 50331648 is not supported"):
        load_gguf(bad)


def test_a_zero_alignment_is_one_clear_error(tmp_path):
    import gguf

    path = tmp_path / "align.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(GGUFError, match="general.alignment must be a positive integer, got 0"):
        load_gguf(path)
