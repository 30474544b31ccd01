"""Moonshot-style checkpoints for the tests: a random ``deepseek_v3`` model published as ``kimi_k2``
with a ``tiktoken.model`` tokenizer (no ``tokenizer.json``) and a chat template in Kimi-K2's
layout, as Kimi-K2-Instruct ships them. The ranks are a byte-level BPE learnt here on a small
text; the special tokens follow them, named by ``added_tokens_decoder``."""
from __future__ import annotations

import base64
import collections
import json
import shutil
from pathlib import Path

from tiny_models import _TEXT

SPECIALS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
            "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")
TOOL_TAGS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>")
MERGES = 120
RESERVED = 258
#: the vocabulary a model needs for these ranks and their special places
VOCAB = 256 + MERGES + RESERVED

TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if loop.first and m.role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- set role = m.name or m.role -%}"
    "{%- if m.role == 'user' -%}<|im_user|>{{ role }}<|im_middle|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>{{ role }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ role }}<|im_middle|>{%- endif -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}{{ m.content or '' }}<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{{ tc.function.arguments if tc.function.arguments is string else (tc.function.arguments | tojson) }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- elif m.role == 'tool' -%}## Return of {{ m.tool_call_id }}\n{{ m.content }}"
    "{%- else -%}{{ m.content or '' }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

CORPUS = _TEXT + "你好，世界。今天天气很好。Hello 你好 World's weather." * 10


def learn_ranks(text: str = CORPUS, merges: int = MERGES, extra: tuple[bytes, ...] = ()) -> dict[bytes, int]:
    """Byte tokens, then the most frequent adjacent pair of each word merged, ``merges`` times
    (then ``extra`` tokens): ranks as ``tiktoken.model`` lists them."""
    ranks = {bytes([i]): i for i in range(256)}
    words = collections.Counter(w.encode() for w in text.replace(" ", "\n ").split("\n") if w)
    split = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for w, parts in split.items():
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _n = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        for w, parts in split.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            split[w] = out
    for token in extra:
        ranks.setdefault(token, len(ranks))
    return ranks


def write_tiktoken(folder: Path, ranks: dict[bytes, int], template: str = TEMPLATE,
                   specials: tuple[str, ...] = SPECIALS + TOOL_TAGS, sort_tools: bool = False) -> dict[str, int]:
    """``folder``'s tokenizer replaced by Moonshot's files: ``tiktoken.model``, a
    ``tokenizer_config.json`` naming ``specials`` after the ranks, and (``sort_tools``) a
    ``tokenization_kimi.py`` whose apply_chat_template sorts the tools' keys. Returns the
    special tokens' ids."""
    (folder / "tokenizer.json").unlink(missing_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    ids = {t: len(ranks) + i for i, t in enumerate(specials)}
    config = {"tokenizer_class": "TikTokenTokenizer",
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False} for t, i in ids.items()},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": template, "model_max_length": 2048}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if sort_tools:
        (folder / "tokenization_kimi.py").write_text(
            "def apply_chat_template(self, conversation, tools=None, **kw):\n"
            "    tools = deep_sort_dict(tools)\n")
    return ids


def kimi_folder(src: Path, dst: Path, template: str = TEMPLATE) -> Path:
    """A copy of the ``deepseek_v3`` checkpoint ``src`` (made with ``vocab_size=VOCAB``) published
    as Kimi-K2 is: ``model_type`` ``kimi_k2``, the tiktoken tokenizer, ``<|im_end|>`` ending a turn."""
    shutil.copytree(src, dst)
    ids = write_tiktoken(dst, learn_ranks(), template)
    config = json.loads((dst / "config.json").read_text())
    assert config["vocab_size"] == VOCAB, "make the source checkpoint with vocab_size=VOCAB"
    (dst / "config.json").write_text(json.dumps(dict(config, model_type="kimi_k2", eos_token_id=ids["<|im_end|>"],
                                                     bos_token_id=ids["[BOS]"])))
    gen = dst / "generation_config.json"
    gen_cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps(dict(gen_cfg, eos_token_id=ids["<|im_end|>"], bos_token_id=ids["[BOS]"])))
    return dst
