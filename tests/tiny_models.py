"""Tiny random checkpoints written by transformers' ``save_pretrained`` (hub layout), with a
byte-level BPE tokenizer and a ChatML template, for exact parity tests and live-server tests.

``make_tiny_checkpoint(path, model_type="qwen3_moe", **config_overrides)`` returns the folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tiny_configs import BASE, BIAS_STD, MOE, UNLISTED, VISION, classes

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special, as in real Qwen3 tokenizers: decoding keeps them in the text.
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools: {{ tools | tojson }}\n"
    "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% elif m.content %}"
    "{% for part in m.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments if c.function.arguments is string else (c.function.arguments | tojson) }}}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
         "def add(a, b):\n    return a + b\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n") * 20

def build_tokenizer(vocab_size: int, extra_tags: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tags = [*TAGS, *extra_tags]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(tags), special_tokens=SPECIALS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    tok.add_tokens(tags)
    return tok


def make_tiny_checkpoint(path, model_type: str = "qwen3_moe", seed: int = 0, shard_kb: int | None = None,
                         vocab_size: int = 320, init_std: float = 0.2, extra_tags: tuple[str, ...] = (),
                         **overrides) -> Path:
    """Write a random ``model_type`` checkpoint (float32) with tokenizer files into ``path``;
    ``extra_tags``: more added (not special) tokens, as TAGS are.

    ``init_std`` larger than transformers' 0.02 makes logits and routing decisive, so greedy
    decoding and top-k routing have no near-ties that float rounding could flip.
    """
    import torch
    path = Path(path)
    tok = build_tokenizer(vocab_size, extra_tags)
    eos = tok.token_to_id("<|im_end|>")
    cfg_cls, model_cls = classes(model_type)
    kwargs = dict(BASE, vocab_size=vocab_size, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                  max_position_embeddings=512, initializer_range=init_std)
    kwargs.update(MOE[model_type])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    if model_type in VISION:
        kwargs = dict(text_config=kwargs, vision_config=VISION[model_type], eos_token_id=eos,
                      tie_word_embeddings=kwargs.pop("tie_word_embeddings", False))
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "expert_bias")):   # transformers starts it at zero
                buf.copy_(BIAS_STD[model_type] * torch.randn(buf.shape))
            if name.endswith("self_attn.sinks"):                            # likewise
                buf.copy_(torch.randn(buf.shape))
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):   # likewise (gpt-oss)
                buf.copy_(0.3 * torch.randn(buf.shape))
    save = {"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}
    model.save_pretrained(path, **save)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
         "model_max_length": 512}))
    return path


def load_reference(path):
    """The same checkpoint in transformers (float32, eager attention)."""
    import transformers as T
    model_type = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    # multimodal classes, and text ones transformers' auto classes do not list (Mistral 4): by name
    cls = classes(model_type)[1] if model_type in VISION or model_type in UNLISTED else T.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype="float32", attn_implementation="eager").eval()


#: families whose transformers reference changed after the GPU machine's transformers (5.17):
#: Granite 4.0-H is 0.87 off in its logits there, against the engine on the CPU and on CUDA alike,
#: while CI's 5.25 and the engine agree to 1e-5 (tests/engine/test_parity.py). Where this
#: machine's transformers is older than the version named, ``gpu_reference`` gives the
#: engine's float32 CPU path instead, which CI holds to that version.
MOVED_REFERENCE = {"granitemoehybrid": (5, 25)}


class EngineCpuReference:
    """The engine's float32 CPU path with the surface the GPU tests use of a transformers
    model: ``ref(ids).logits`` and ``ref.generate(ids, max_new_tokens=...)`` (greedy)."""

    def __init__(self, path):
        from freetoken_engine import LLM
        self.llm = LLM(path, device="cpu", dtype="float32")
        self.generation_config = SimpleNamespace(eos_token_id=None)

    def __call__(self, ids):
        return SimpleNamespace(logits=self.llm.prefill_logits(ids[0].tolist())[None])

    def generate(self, ids, max_new_tokens: int, **_):
        import torch

        from freetoken_engine import SamplingParams
        prompt = ids[0].tolist()
        out = self.llm.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                                                       ignore_eos=True)).token_ids
        return torch.tensor([prompt + list(out)])


def gpu_reference(path, model_type: str):
    """transformers' model of ``path``, or the engine's CPU path where this machine's
    transformers predates a family's ``MOVED_REFERENCE``."""
    import transformers
    moved = MOVED_REFERENCE.get(model_type)
    if moved is not None and tuple(int(p) for p in transformers.__version__.split(".")[:2]) < moved:
        return EngineCpuReference(path)
    return load_reference(path)


def with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of the model folder ``src`` at ``dst`` whose tokenizer has ``template`` as its chat template."""
    import shutil
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template)))
    return dst


def uneven_norms(folder: Path, suffixes: tuple[str, ...], seed: int = 0) -> Path:
    """The RMSNorm weights of ``folder`` whose names end with ``suffixes`` made random (about 1):
    a checkpoint starts them at one, where two norms swapped, or a norm and the rotary (which
    keeps each head's length), give the same numbers and a test could not tell them apart."""
    import torch
    from safetensors.torch import load_file, save_file
    torch.manual_seed(seed)
    state = load_file(folder / "model.safetensors")
    for key in sorted(state):
        if key.endswith(suffixes):
            state[key] = 1 + 0.5 * torch.randn(state[key].shape)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def mark_special(folder: Path, tag: str) -> Path:
    """The added token ``tag`` of ``folder``'s tokenizer marked special, as Granite's
    ``<|tool_call|>`` is: decoding leaves it out."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    entry = next(t for t in data["added_tokens"] if t["content"] == tag)
    entry["special"] = True
    path.write_text(json.dumps(data))
    return folder


def copy_folder(src: Path, dst: Path) -> Path:
    """A flat copy of the model folder ``src`` at ``dst`` (new files: new inodes and mtimes)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edited_config(src: Path, dst: Path, change) -> Path:
    """A copy of the model folder ``src`` at ``dst`` whose config.json dict ``change`` edits in
    place (a config the engine must read, or refuse)."""
    folder = copy_folder(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def scale_config(folder: Path, key: str, factor: int) -> None:
    """Multiply ``key`` of ``folder``'s config.json by ``factor`` (a config that no longer fits
    the weights)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] *= factor
    (folder / "config.json").write_text(json.dumps(cfg))


def gate_bank_reads(monkeypatch, files: str = "bank-"):
    """Packed bank blocks (of files whose name starts with ``files``) wait until the returned
    ``threading.Event`` is set (at most 60 s): the read is still going for as long as a test wants."""
    import threading

    from freetoken_engine.packed import early
    read, gate = early.Fill._read, threading.Event()

    def gated(self, name, *rest):
        if name.startswith(files):
            gate.wait(60)
        read(self, name, *rest)
    monkeypatch.setattr(early.Fill, "_read", gated)
    return gate


def mtp_reference(path):
    """The multi-token-prediction layer of ``path`` (written by ``add_mtp_layer``) built from
    transformers' own Qwen3-Next modules: ``(fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layer,
    norm)``, float32. ``layer`` is a full-attention ``Qwen3NextDecoderLayer``."""
    import torch
    import transformers as T
    from safetensors.torch import load_file
    from transformers.models.qwen3_next import modeling_qwen3_next as Q
    cfg = T.AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    full = cfg.layer_types.index("full_attention")
    parts = dict(fc=torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False),
                 pre_fc_norm_embedding=Q.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                 pre_fc_norm_hidden=Q.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
                 layer=Q.Qwen3NextDecoderLayer(cfg, full),
                 norm=Q.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
    path = Path(path)
    if (path / "mtp.safetensors").is_file():
        state = load_file(path / "mtp.safetensors")
        for name, module in parts.items():
            stem = "mtp.layers.0." if name == "layer" else f"mtp.{name}."
            module.load_state_dict({k[len(stem):]: v for k, v in state.items() if k.startswith(stem)})
    return {k: m.float().eval() for k, m in parts.items()}


def save_mtp_layer(path, parts: dict) -> None:
    """Write the MTP modules ``parts`` (``mtp_reference``) into ``path`` as ``mtp.*`` tensors
    (``mtp.safetensors``, added to the shard index when there is one) and name one MTP layer in
    config.json, as Qwen3-Next checkpoints ship it."""
    from safetensors.torch import save_file
    path = Path(path)
    state = {}
    for name, module in parts.items():
        stem = "mtp.layers.0." if name == "layer" else f"mtp.{name}."
        state.update({stem + k: v.detach().contiguous() for k, v in module.state_dict().items()})
    save_file(state, str(path / "mtp.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: "mtp.safetensors" for k in state})
        index.write_text(json.dumps(data))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))


def add_mtp_layer(path, seed: int = 1, init_std: float = 0.2) -> None:
    """Give the Qwen3-Next checkpoint at ``path`` a random MTP layer (``mtp.*``)."""
    import torch
    parts = mtp_reference(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in parts.values():
            for name, p in module.named_parameters():
                if name.endswith("norm.weight") or name == "weight" and p.dim() == 1:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))       # norms scale by 1 + weight
                else:
                    p.copy_(init_std * torch.randn(p.shape, generator=g))
    save_mtp_layer(path, parts)


if __name__ == "__main__":       # checkpoints for a machine whose transformers lacks the family (conftest.PREBUILT)
    import sys
    if len(sys.argv) < 3:
        sys.exit("usage: python tests/tiny_models.py DIR MODEL_TYPE...")
    for kind in sys.argv[2:]:
        print(make_tiny_checkpoint(Path(sys.argv[1]) / kind, kind))
