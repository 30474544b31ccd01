"""Moonshot's checkpoints (Kimi-K2, Moonlight): the ``kimi_k2`` model type on DeepSeek-V3's
architecture, and the tiktoken tokenizer they ship instead of a ``tokenizer.json``.

The tokenizer must give the ids the checkpoint's own ``TikTokenTokenizer`` gives: the ``tiktoken``
library over the same ranks, Kimi's split pattern (Han runs apart from other letters) and the
special tokens named by ``tokenizer_config.json``, every special token written in the text read
as that token."""
from __future__ import annotations

import json

import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kimi_models import SPECIALS, TOOL_TAGS, VOCAB, kimi_folder, learn_ranks, write_tiktoken
from tiny_models import load_reference

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.models.tiktoken_tokenizer import KIMI_PATTERN
from freetoken_engine.models.tokenizer import Tokenizer, load_tokenizer

HAN_LATIN = "o你".encode()       # a token no Kimi split can reach: "o" and "你" are split apart


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-tok")
    ids = write_tiktoken(path, learn_ranks(extra=(HAN_LATIN,)))
    return path, ids


def reference(path) -> tiktoken.Encoding:
    """The checkpoint's TikTokenTokenizer, as its tokenization_kimi.py builds it: tiktoken's own
    reader of the ranks, the special tokens after them."""
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(str(path / "tiktoken.model"))
    named = {int(k): v["content"] for k, v in json.loads((path / "tokenizer_config.json").read_text())
             ["added_tokens_decoder"].items()}
    special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 258)}
    return tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)


TEXTS = ["Hello 你好 World's weather.", "def add(a, b):\n    return a + b\n", "HELLO world I'm here 12345",
         "<|im_user|>user<|im_middle|>天气很好<|im_end|>", "  spaces\t\ttabs\n\n\nlines ", "naïve café Ωmega 日本語テキスト"]


def same_as_reference(path, text: str) -> None:
    """``text``'s ids are the reference's, and they decode back to ``text``."""
    tok = Tokenizer(path)
    ids = tok.encode(text)
    assert ids == reference(path).encode(text, allowed_special="all")
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_the_checkpoint_tokenizers(folder, text):
    same_as_reference(folder[0], text)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("ab AB1你好。\n'sé") + ["<|im_end|>", "<|tool_call_begin|>"]),
                max_size=40).map("".join))
def test_any_text_round_trips_with_the_reference_ids(folder, text):
    same_as_reference(folder[0], text)


def test_han_runs_are_split_from_other_letters(folder):
    path, _ = folder
    tok = Tokenizer(path)
    han_latin = tok.token_to_id(HAN_LATIN.decode())
    assert han_latin is not None and han_latin not in tok.encode("o你好")
    # the same ranks under a split that keeps letters together would use it: the pattern matters
    loose = tiktoken.Encoding(name="loose", pat_str=r"\p{L}+|\s+|[^\s\p{L}]+", mergeable_ranks=tok.tiktoken.ranks,
                              special_tokens={})
    assert han_latin in loose.encode("o你")


def test_special_tokens_follow_the_ranks_and_decoding_leaves_them_out(folder):
    path, ids = folder
    tok = Tokenizer(path)
    base = len(tok.tiktoken.ranks)
    assert ids["[BOS]"] == base and tok.token_to_id("[BOS]") == base
    assert tok.token_to_id("<|im_end|>") == ids["<|im_end|>"]
    assert tok.token_to_id(f"<|reserved_token_{base + 257}|>") == base + 257          # unnamed places
    assert tok.vocab_size == base + 258
    text = "<|tool_calls_section_begin|>x<|im_end|>"
    got = tok.encode(text)
    assert got[0] == ids["<|tool_calls_section_begin|>"] and got[-1] == ids["<|im_end|>"]
    assert tok.decode(got) == "x"
    decoder = tok.stream_decoder(TOOL_TAGS)
    assert "".join(decoder.step(i) for i in got) == "<|tool_calls_section_begin|>x"
    assert tok.eos_token == "[EOS]" and ids["[EOS]"] in tok.eos_token_ids


def test_a_half_written_character_waits_for_its_other_bytes(folder):
    path, _ = folder
    tok = Tokenizer(path)
    ids = tok.encode("天气")
    byte_ids = [tok.tiktoken.ranks[bytes([b])] for b in "天".encode()]
    decoder = tok.stream_decoder()
    assert [decoder.step(i) for i in byte_ids] == ["", "", "天"]
    assert tok.decode(ids) == "天气"


def test_the_tools_keys_are_sorted_when_the_checkpoints_code_sorts_them(tmp_path):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}},
                                               "description": "d"}}]
    msgs = [{"role": "user", "content": "hi"}]
    plain, sorted_ = tmp_path / "plain", tmp_path / "sorted"
    plain.mkdir(), sorted_.mkdir()
    write_tiktoken(plain, learn_ranks(merges=4))
    write_tiktoken(sorted_, learn_ranks(merges=4), sort_tools=True)
    assert '[{"type":"function","function":{"name":"f",' in Tokenizer(plain).apply_chat_template(msgs, tools)
    assert '[{"function":{"description":"d","name":"f",' in Tokenizer(sorted_).apply_chat_template(msgs, tools)


@pytest.mark.parametrize("line, message", [
    ("not-base64! 0", "line 1 is not 'base64-token rank'"),
    ("QQ== 0\nQQ== 1", "line 2 repeats a token"),
    ("QQ== 0\nQg== 5", "ranks must run from 0"),
])
def test_a_corrupt_tiktoken_file_is_refused_with_its_line(tmp_path, line, message):
    write_tiktoken(tmp_path, {b"A": 0})
    (tmp_path / "tiktoken.model").write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        Tokenizer(tmp_path)


def test_an_unknown_tiktoken_tokenizer_and_misplaced_specials_are_refused(tmp_path):
    write_tiktoken(tmp_path, learn_ranks(merges=2))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, tokenizer_class="QWenTokenizer",
                                                                    auto_map={})))
    with pytest.raises(ConfigError, match="other than Moonshot's TikTokenTokenizer"):
        Tokenizer(tmp_path)
    config["added_tokens_decoder"] = {"3": {"content": "<|im_end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"added token ids \[3\] are not in the special range"):
        Tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").unlink()
    assert load_tokenizer(tmp_path) is None


@pytest.fixture(scope="module")
def kimi(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("deepseek_v3", vocab_size=VOCAB, max_position_embeddings=2048)
    return src, kimi_folder(src, tmp_path_factory.mktemp("kimi") / "m")


def test_kimi_k2_runs_as_deepseek_v3_token_for_token(kimi):
    """Kimi-K2's ``kimi_k2`` checkpoint is DeepSeek-V3's architecture: the same weights give
    transformers' DeepSeek-V3 tokens, from a prompt its tokenizer and template make."""
    src, path = kimi
    llm = LLM(path, dtype="float32")
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "你好, what's the weather?"}])
    assert prompt[-1] == llm.tokenizer.token_to_id("<|im_middle|>")
    ref = load_reference(src)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = llm.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert got.token_ids == want[0, len(prompt):].tolist()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0]
    assert (llm.forward_logits(prompt) - logits).abs().max() < 1e-4
    assert set(SPECIALS) <= {llm.tokenizer.tiktoken._by_id[i] for i in llm.tokenizer.tiktoken._by_id}


def test_a_packed_folder_stands_alone_with_the_tiktoken_tokenizer(kimi, tmp_path):
    """``freetoken convert`` copies ``tiktoken.model`` and the tokenizer config: the packed folder
    reads the same tokenizer and gives the same tokens."""
    from freetoken_engine.packed import convert
    _, path = kimi
    packed = LLM(convert(path, tmp_path / "packed", progress=False), dtype="float32")
    llm = LLM(path, dtype="float32")
    msgs = [{"role": "user", "content": "天气 today?"}]
    assert packed.tokenizer.tiktoken is not None
    assert packed.tokenizer.encode_chat(msgs) == llm.tokenizer.encode_chat(msgs)
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompt = llm.tokenizer.encode_chat(msgs)
    assert packed.generate(prompt, greedy).token_ids == llm.generate(prompt, greedy).token_ids
