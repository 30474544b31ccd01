"""Tokenizer and chat template exactly as the checkpoint ships them.

``tokenizer.json`` is read with the ``tokenizers`` library (Moonshot's ``tiktoken.model`` with the
``tiktoken`` library: ``models/tiktoken_tokenizer.py``); the chat template comes from
``tokenizer_config.json`` (or ``chat_template.jinja``) and is rendered with a sandboxed jinja2
environment offering what Hugging Face templates expect of transformers' renderer: the helpers
``raise_exception`` and ``strftime_now``, its ``tojson`` (non-ASCII kept; ``indent``,
``separators``, ``sort_keys``), ``{% break %}`` / ``{% continue %}``, and ``{% generation %}``
blocks (rendered as their body). A template that does not parse fails the load with its line.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import ConfigError, InvalidRequest
from .tiktoken_tokenizer import TiktokenModel, is_tiktoken_folder


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part with it
    (for training masks); here the block renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class StreamDecoder:
    """Incremental detokenizer: ``step(id)`` returns the newly printable text (may be '').
    Special tokens are left out, but for those in ``keep`` (a tool-call format's tag that the
    tokenizer marks special, as Granite's ``<|tool_call|>`` and LFM2's): their text is written."""

    def __init__(self, tok: "Tokenizer", keep: tuple[str, ...] = ()):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0
        ids = {t: tok.token_to_id(t) for t in keep}
        self.keep = {i: t for t, i in ids.items() if i is not None and not tok.decode([i])}

    def step(self, token_id: int) -> str:
        if token_id in self.keep:            # what came before it, then the tag; decoding starts over after it
            done, full = self.tok.decode(self.ids[self.prefix:self.read]), self.tok.decode(self.ids[self.prefix:])
            self.ids.append(token_id)
            self.prefix = self.read = len(self.ids)
            return full[len(done):] + self.keep[token_id]
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        full = self.tok.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""                       # an incomplete UTF-8 sequence: wait for more bytes
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(prefix_text):]


def _sorts_tools(folder: Path) -> bool:
    """Whether the checkpoint's own tokenizer code sorts every key of the tools before its template
    renders them (Moonshot's later ``tokenization_kimi.py``: ``deep_sort_dict``)."""
    return any("deep_sort_dict(tools)" in f.read_text(errors="replace") for f in folder.glob("tokenization_*.py"))


def _deep_sorted(value):
    if isinstance(value, dict):
        return {k: _deep_sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_deep_sorted(v) for v in value]
    return value


class Tokenizer:
    def __init__(self, folder: Path, eos_ids: tuple[int, ...] = ()):
        cfg_path = folder / "tokenizer_config.json"
        try:
            self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except ValueError as exc:
            raise ConfigError(f"cannot read {cfg_path}: {exc}") from None
        #: Moonshot's tiktoken tokenizer (``tiktoken_tokenizer.TiktokenModel``), or None
        self.tiktoken: TiktokenModel | None = None
        if is_tiktoken_folder(folder):
            self._tok = self.tiktoken = TiktokenModel(folder, self.config)
        else:
            path = folder / "tokenizer.json"
            try:
                self._tok = _HFTokenizer.from_file(str(path))
            except Exception as exc:  # the library raises a bare Exception on parse errors
                raise ConfigError(f"cannot read {path}: {exc}") from None
        self._sort_tools = _sorts_tools(folder)
        template = self.config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):   # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        ids = list(eos_ids)
        if self.eos_token and (eid := self._tok.token_to_id(self.eos_token)) is not None and eid not in ids:
            ids.append(eid)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=[loopcontrols, _GenerationBlocks])
        self._env.globals.update(raise_exception=_raise,
                                 strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self._env.filters["tojson"] = _tojson
        try:
            self._compiled = self._env.from_string(template) if template else None
        except TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template in {folder} does not parse: line {exc.lineno}: {exc.message}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @functools.cached_property
    def json_text(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (for the grammar engine); built once. Not for a
        tiktoken tokenizer, which the grammar engine reads from its ranks (``tiktoken``)."""
        if self.tiktoken is not None:
            raise TypeError("a tiktoken tokenizer has no tokenizer.json text: read its ranks")
        return self._tok.to_str()

    @functools.cached_property
    def identity(self) -> str:
        """What tells this tokenizer apart from any other (the grammar engine's tables are built
        once per identity): its ``tokenizer.json`` text, or its ``tiktoken.model``'s digest."""
        return "tiktoken:" + self.tiktoken.digest if self.tiktoken is not None else self.json_text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def added_tokens(self) -> frozenset[str]:
        """The tokens added to the vocabulary as wholes (special or not): a chat format's tags, as
        opposed to text a merge happens to spell."""
        if self.tiktoken is not None:
            return frozenset(self.tiktoken.special)
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values())

    def stream_decoder(self, keep: tuple[str, ...] = ()) -> StreamDecoder:
        return StreamDecoder(self, keep)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **extra) -> str:
        """Render the checkpoint's chat template; without one, a plain ``role: content`` layout."""
        if self._compiled is None:
            lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        if tools and self._sort_tools:
            tools = _deep_sorted(tools)
        try:
            return self._compiled.render(messages=messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         **extra)
        except TemplateError as exc:
            raise InvalidRequest(f"the model's chat template rejected the messages: {exc}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **extra) -> list[int]:
        """Template then encode without adding special tokens again (the template has them)."""
        return self.encode(self.apply_chat_template(messages, tools, **extra), add_special_tokens=False)


def has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or is_tiktoken_folder(folder)


def load_tokenizer(folder: Path, eos_ids: tuple[int, ...] = ()) -> Tokenizer | None:
    return Tokenizer(folder, eos_ids) if has_tokenizer(folder) else None
