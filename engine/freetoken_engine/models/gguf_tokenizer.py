"""The tokenizer of a GGUF file (``models/gguf.py``): llama.cpp's byte-level BPE
(``tokenizer.ggml.model == "gpt2"``) rebuilt with ``tokenizers``, split as its model was trained."""
from __future__ import annotations

from .gguf_file import GGUFError

_SPECIAL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED

# llama.cpp's pre-tokenizer names -> the split their models were trained with
_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
             r"\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+",
}


def tokenizer_files(meta: dict) -> tuple[str, dict]:
    """(``tokenizer.json`` text, ``tokenizer_config.json`` fields) of a GGUF file's metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} (only gpt2 BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _SPLITS:          # the model's own split (Qwen's, Llama 3's), then bytes
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # llama.cpp's "smollm"/"starcoder"-style pre-tokenizers split every digit on its own first.
    elif pre in ("smollm", "starcoder", "refact", "deepseek-coder"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
    )

    def name(key):
        idx = meta.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        tcfg["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), tcfg
