"""The tiktoken tokenizer of Moonshot's checkpoints (Kimi-K2, Kimi-K2-Thinking, Moonlight,
Kimi-Linear), which ship ``tiktoken.model`` and a ``TikTokenTokenizer`` in Python instead of a
``tokenizer.json``.

``tiktoken.model`` holds one ``base64(token bytes) rank`` line per mergeable token; the special
tokens follow the last rank (256 reserved places and two more), named by ``tokenizer_config.json``'s
``added_tokens_decoder`` or ``<|reserved_token_{id}|>``. Text is split by Kimi's pattern (runs of
Han characters apart from other letters, then GPT-4's rules) and merged by rank: the ``tiktoken``
library itself does both, so the ids are the checkpoint's own tokenizer's, and every special
token written in the text is that token (its ``encode(..., allowed_special="all")``).

``TiktokenModel`` answers the part of ``tokenizers.Tokenizer`` that ``models/tokenizer.Tokenizer``
uses; llguidance builds its view from the ranks, specials and pattern (``executor/guide.py``).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

FILE = "tiktoken.model"
RESERVED = 256 + 2           # special places after the last rank (TikTokenTokenizer's 256, and 2)

#: TikTokenTokenizer.pat_str of Moonshot's tokenization_kimi.py / tokenization_moonshot.py
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def is_tiktoken_folder(folder: Path) -> bool:
    return (folder / FILE).is_file() and not (folder / "tokenizer.json").is_file()


def read_ranks(path: Path, data: bytes) -> dict[bytes, int]:
    """``tiktoken.model``'s mergeable tokens (``data``, the file at ``path``): bytes -> rank. A line
    that is not ``base64 rank``, a rank given twice, or ranks that are not 0..n-1 fail with the
    line to fix."""
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}: line {number} is not 'base64-token rank'") from None
        if rank in seen or token in ranks:
            raise ConfigError(f"{path}: line {number} repeats a token or the rank {rank}")
        ranks[token] = rank
        seen.add(rank)
    if not ranks or max(seen) != len(ranks) - 1:
        raise ConfigError(f"{path}: ranks must run from 0 to the number of tokens - 1 "
                          f"({len(ranks)} tokens, highest rank {max(seen, default=-1)})")
    return ranks


@dataclass
class _Encoding:
    ids: list[int]


class TiktokenModel:
    """The checkpoint's tiktoken tokenizer with the methods of ``tokenizers.Tokenizer`` that the
    engine calls (``encode(text).ids``, ``decode``, ``token_to_id``, ``get_vocab_size``)."""

    def __init__(self, folder: Path, config: dict):
        import tiktoken

        cls = str(config.get("tokenizer_class") or "")
        auto = json.dumps(config.get("auto_map") or {})
        if "TikTokenTokenizer" not in cls + auto:
            raise ConfigError(f"{folder / FILE}: a tiktoken tokenizer other than Moonshot's TikTokenTokenizer "
                              f"(tokenizer_class {cls or 'not given'}), whose split pattern is not known here")
        data = (folder / FILE).read_bytes()                 # read once: the ranks and the digest
        self.ranks = read_ranks(folder / FILE, data)
        self.digest = hashlib.sha256(data).hexdigest()
        base = len(self.ranks)
        named = {}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not str(key).isdigit() or not isinstance(content, str):
                raise ConfigError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r} needs "
                                  "a numeric id and a content string")
            named[int(key)] = content
        outside = sorted(i for i in named if not base <= i < base + RESERVED)
        if outside:
            raise ConfigError(f"{folder / 'tokenizer_config.json'}: added token ids {outside[:3]} are not in "
                              f"the special range {base}..{base + RESERVED - 1} after tiktoken.model's ranks")
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, base + RESERVED)}
        self.pattern = KIMI_PATTERN
        self._by_id = {i: t for t, i in self.special.items()}
        self._enc = tiktoken.Encoding(name=str(folder / FILE), pat_str=self.pattern, mergeable_ranks=self.ranks,
                                      special_tokens=self.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        """Moonshot's tokenizer adds no BOS of its own: ``add_special_tokens`` changes nothing."""
        return _Encoding(self._enc.encode(text, allowed_special="all"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._by_id]
        return self._enc.decode([i for i in ids if 0 <= i < self._enc.n_vocab])

    def token_to_id(self, token: str) -> int | None:
        if token in self.special:
            return self.special[token]
        return self.ranks.get(token.encode("utf-8"))

    def get_vocab_size(self) -> int:
        return len(self.ranks) + len(self.special)
