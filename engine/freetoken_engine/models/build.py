"""Build a model from a checkpoint folder: non-expert weights into the module, routed experts
into the host expert bank (final layout, filled expert by expert, then pinned)."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable

import torch

from ..cache.bank import ExpertBank
from ..config import ModelConfig
from ..errors import ConfigError
from ..layers.rope import Rotary
from . import family
from .decoder import DecoderLM
from .loader import Checkpoint

log = logging.getLogger(__name__)
Progress = Callable[[float], None]


def read_config(folder: Path, dtype: torch.dtype | None = None, progress: Progress | None = None):
    """-> (checkpoint, ModelConfig). A packed folder (``freetoken convert``) is read straight
    into its final bank layout (``progress``: the fraction of its bytes read, up to 0.99); a
    Hugging Face folder is validated and read lazily."""
    from ..packed import is_packed, load_packed
    if is_packed(folder):
        # the bank pins itself after; it is still being read while the dense weights go to the
        # device (build_model calls finish() before it touches the bank)
        ckpt = load_packed(folder, dtype=dtype, pin="none", defer_bank=True,
                           progress=(lambda f: progress(0.99 * f)) if progress else None)
    else:
        ckpt = Checkpoint(folder)
    fam = family(ckpt.config.get("model_type"))
    return ckpt, fam.parse(ckpt.config)


@contextlib.contextmanager
def no_init():
    """Skip ``torch.nn.init`` while modules are built on the meta device: every parameter is
    overwritten from the checkpoint, and the init functions' meta-device path imports
    ``torch._dynamo`` and sympy (about 1 s of every start, several on a cold disk)."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def build_model(folder: Path, dtype: torch.dtype, device: torch.device,
                progress: Progress | None = None) -> tuple[DecoderLM, ExpertBank | None, ModelConfig]:
    ckpt, cfg = read_config(folder, dtype, progress)
    try:
        return _build(folder, ckpt, cfg, dtype, device, progress)
    except BaseException:
        ckpt.close()                    # a packed bank still being read stops there
        raise


def _build(folder: Path, ckpt, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
           progress: Progress | None) -> tuple[DecoderLM, ExpertBank | None, ModelConfig]:
    fam = family(cfg.model_type)
    rotary = Rotary(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
    with torch.device("meta"), no_init():
        model = DecoderLM(cfg, rotary).to(dtype)       # cast while still free: no fp32 pass
    # Module.to_empty would call empty_like on meta tensors, whose reference path imports sympy.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    params = dict(model.named_parameters())
    tied = cfg.tie_word_embeddings or not ckpt.has("lm_head.weight")
    wanted = [k for k in params if not (tied and k == "lm_head.weight")]
    by_engine_name = {fam.rename(k): k for k in ckpt.names()}
    bank = None
    packed = hasattr(ckpt, "bank_tensors")
    if cfg.moe:
        m = cfg.moe
        try:
            bank = ExpertBank(len(m.layers), m.num_experts, cfg.hidden_size, m.intermediate_size, dtype,
                              *(ckpt.bank_tensors() if packed else ()))
        except ValueError as exc:
            raise ConfigError(f"packed checkpoint {folder}: {exc}") from None
    total = len(wanted) + (bank.total_experts if bank and not packed else 0)
    done = 0
    with torch.no_grad():
        for name in wanted:
            src = by_engine_name.get(name)
            if src is None:
                raise ConfigError(f"checkpoint {folder} lacks tensor for {name}")
            t = ckpt.get(src)
            if t.shape != params[name].shape:
                raise ConfigError(f"tensor {src} has shape {tuple(t.shape)}, config implies {tuple(params[name].shape)}")
            params[name].copy_(t)
            done += 1
            if progress and not packed and done % 16 == 0:   # a packed folder's progress is its read
                progress(done / total)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        if packed:
            ckpt.finish()                                      # the rest of the bank's read
            if bank is not None:
                bank.pin()                                     # read in its final layout already
        elif bank is not None:
            for li, layer in enumerate(cfg.moe.layers):
                for e in range(cfg.moe.num_experts):
                    gate, up, down = (ckpt.get(fam.expert_key(layer, e, p)) for p in range(3))
                    if gate.shape != (bank.inter, bank.hidden) or down.shape != (bank.hidden, bank.inter):
                        raise ConfigError(f"expert {e} of layer {layer} has shape {tuple(gate.shape)}, "
                                          f"config implies {(bank.inter, bank.hidden)}")
                    bank.fill(li, e, gate, up, down)
                    done += 1
                if progress:
                    progress(done / total)
            bank.pin()
    ckpt.close()
    for module in model.modules():
        if hasattr(module, "fuse"):
            module.fuse()
    model.eval()
    return model, bank, cfg
