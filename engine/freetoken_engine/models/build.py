"""Build a model from a checkpoint folder: non-expert weights into the module, routed experts
into the host expert bank (final layout, filled expert by expert, then pinned)."""
from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import replace
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
# the weights that end a residual branch, which take ModelConfig.residual_multiplier
_BRANCH_END = re.compile(r"\.(self_attn\.o_proj|linear_attn\.out_proj|mlp\.down_proj|mlp\.shared_expert\.down_proj)"
                         r"\.(weight|bias)$")
Progress = Callable[[float], None]


def bank_store(dtype: torch.dtype, device: torch.device, source: torch.dtype | None) -> torch.dtype:
    """The dtype a dense expert bank holds for a model computing in ``dtype`` on ``device`` whose
    checkpoint stores its experts in ``source``: a CPU engine computing in float32 keeps bfloat16
    experts as they are (the compiled kernel reads bfloat16 rows and computes in float32, so the
    values and the results are those of a float32 bank, from half the bytes and half the host
    memory); otherwise the model's dtype."""
    if device.type == "cpu" and dtype == torch.float32 and source == torch.bfloat16:
        return torch.bfloat16
    return dtype


def host_memory() -> tuple[int, int] | None:
    """(available, free swap) bytes of this machine's memory (Linux ``/proc/meminfo``), or None."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(info["MemAvailable"].split()[0]) * 1024, int(info.get("SwapFree", "0 kB").split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_host_memory(folder: Path, need: int, what: str) -> None:
    """A ConfigError before anything is read when ``need`` bytes of host memory cannot fit in
    what this machine has free, swap included (the kernel would kill the process midway); a
    warning when they fit only by swapping."""
    have = host_memory()
    if have is None or need <= have[0]:
        return
    def size(n: int) -> str:
        return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
    msg = (f"{folder} needs {size(need)} of host memory ({what}); this machine has {size(have[0])} available "
           f"and {size(have[1])} of free swap")
    if need > have[0] + have[1]:
        raise ConfigError(f"{msg}: free memory or run a smaller model")
    log.warning(f"{msg}: it will swap, and decode will run at the disk's speed")


def read_config(folder: Path, dtype: torch.dtype | None = None, progress: Progress | None = None,
                device: torch.device | None = None):
    """-> (checkpoint, ModelConfig). A packed folder (``freetoken convert``) is read straight
    into its final bank layout (``progress``: the fraction of its bytes read, up to 0.99), in
    ``bank_store``'s dtype for ``device`` (``dtype``'s without one); a Hugging Face folder is
    validated and read lazily."""
    from ..packed import is_packed, load_packed
    if is_packed(folder):
        from ..packed.format import read_index
        from .loader import torch_dtype
        index = read_index(Path(folder))
        stored = torch_dtype(index["dtype"])
        if device is not None and dtype is not None:
            dtype = bank_store(dtype, device, stored)
        _check_packed(Path(folder), index, stored, dtype or stored)
        # the bank is still being read (and pinned as it lands: packed/pinning.py) while the
        # dense weights go to the device; BankRead.finish() waits for it before the bank is used
        ckpt = load_packed(folder, dtype=dtype, pin="after", defer_bank=True, index=index,
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


class BankRead:
    """What is left of a model's load once ``start_model`` returns: for a packed folder the rest
    of its bank's read (the bank's bytes are there, and it is pinned, only after ``finish``);
    nothing for a Hugging Face folder, whose bank is filled before ``start_model`` returns."""

    def __init__(self, ckpt=None, bank: ExpertBank | None = None):
        self._ckpt, self._bank = ckpt, bank

    @property
    def pending(self) -> bool:
        return self._ckpt is not None

    def pin_head(self) -> bool:
        """Register the bank's first pages while it is still read, so that decode steps (which
        take the bank as a kernel argument) can be captured before it is in; True when done
        (``PackedModel.pin_head``). Nothing may read the bank's bytes before ``finish``."""
        return self._ckpt is not None and self._ckpt.pin_head()

    def finish(self) -> None:
        """Wait for the bank's read and pin it (raises the read's failure, naming the file)."""
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is None:
            return
        try:
            ckpt.finish()
            if self._bank is not None:
                self._bank.pinned = ckpt.pinned      # pinned as it was read
                self._bank.pin()                     # or here, when that was not possible
        finally:
            ckpt.close()

    def cancel(self) -> None:
        """Stop the read (a start that failed before ``finish``); the bank is unusable after."""
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()


def build_model(folder: Path, dtype: torch.dtype, device: torch.device,
                progress: Progress | None = None, mtp: bool = False,
                expert_format: str = "auto") -> tuple[DecoderLM, ExpertBank | None, ModelConfig]:
    """The model on ``device`` and its filled, pinned expert bank (None without MoE layers)."""
    model, bank, cfg, rest = start_model(folder, dtype, device, progress, mtp, expert_format)
    try:
        rest.finish()
    except BaseException:
        rest.cancel()
        raise
    return model, bank, cfg


def start_model(folder: Path, dtype: torch.dtype, device: torch.device, progress: Progress | None = None,
                mtp: bool = False, expert_format: str = "auto") -> tuple[DecoderLM, ExpertBank | None, ModelConfig,
                                                                         BankRead]:
    """``build_model`` that returns while a packed folder's bank is still being read: the
    caller may do anything that does not read the bank's bytes (allocate the expert cache,
    capture decode graphs with every expert resident) before ``BankRead.finish()``, and must
    call ``cancel()`` if it gives up before that. ``mtp``: load the checkpoint's
    multi-token-prediction layer too (``MtpHead``), for speculative drafts. ``expert_format``:
    ``auto`` keeps a checkpoint's MXFP4 experts in 4 bits unless a GPU holds them all dense
    (``auto_dense``; ``mxfp4``: 4 bits, or fail saying why not), ``dense`` dequantizes them."""
    ckpt, cfg = read_config(folder, dtype, progress, device)
    try:
        if mtp:
            cfg = _with_mtp(folder, ckpt, cfg)
        return _build(folder, ckpt, cfg, dtype, device, progress, expert_format)
    except BaseException:
        ckpt.close()                    # a packed bank still being read stops there
        raise


def _with_mtp(folder: Path, ckpt, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` running the checkpoint's MTP layer, or a ConfigError that says why it cannot."""
    if not cfg.mtp_layers and ckpt.config.get("num_nextn_predict_layers"):
        raise ConfigError(f"{folder}: the engine does not run {cfg.model_type}'s multi-token-prediction layer "
                          f"(yet); use --speculative-method ngram")
    if not cfg.mtp_layers:
        raise ConfigError(f"{folder} has no multi-token-prediction layer (config.json names none: "
                          f"num_nextn_predict_layers / mtp_num_hidden_layers); use --speculative-method ngram")
    if cfg.moe is None:
        raise ConfigError(f"{folder}: the engine runs MTP layers of MoE models only")
    if hasattr(ckpt, "bank_tensors") and not ckpt.index["bank"].get("mtp_layers"):
        raise ConfigError(f"{folder} was packed without the MTP layer's experts (before the packed format "
                          f"carried them): run freetoken convert again for --speculative-method mtp")
    fam = family(cfg.model_type)
    if not fam.has_mtp(cfg, ckpt.names()):
        raise ConfigError(f"{folder}: config.json names {cfg.mtp_layers} MTP layer(s) but the checkpoint "
                          f"holds none of its tensors ({fam.mtp_layer(cfg)}.*)")
    return replace(cfg, use_mtp=True)


#: ``auto`` on a GPU dequantizes 4-bit experts only when all of them, dense, take at most this
#: share of its free memory: every expert is then resident, where the dense kernels are faster (an
#: H100: 1.1-1.3x a decode call, 4x a 2,048-token call); with a cache smaller than the model the
#: 4-bit bank decodes faster (1.75x at 0.4 GB of cache) and takes 3.8x less host memory (docs/gpu.md)
DENSE_ON_GPU_SHARE = 0.8


def auto_dense(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``--expert-format auto`` runs a checkpoint's MXFP4 experts dense on ``device``:
    never on the CPU; on a GPU when the dense bank fits ``DENSE_ON_GPU_SHARE`` of the free memory."""
    if device.type == "cpu" or cfg.moe is None:
        return False
    m = cfg.moe
    dense = cfg.bank_layers * m.num_experts * 3 * cfg.hidden_size * m.intermediate_size * dtype.itemsize
    return dense <= DENSE_ON_GPU_SHARE * torch.cuda.mem_get_info(device)[0]


def _expert_rows(fam, ckpt, cfg: ModelConfig, dense: bool, expert_format: str, folder: Path):
    """The first MoE layer's MXFP4 expert rows (``Family.layer_expert_rows``) when the bank keeps
    the checkpoint's experts in 4 bits (not ``dense``; with ``expert_format`` mxfp4 a ConfigError
    when the checkpoint has none); None: a dense bank."""
    if cfg.moe is None or dense:
        return None
    rows = None
    if cfg.residual_multiplier == 1.0:
        rows = fam.layer_expert_rows(ckpt, cfg.moe.layers[0], cfg.moe.num_experts,
                                     (cfg.hidden_size, cfg.moe.intermediate_size))
    if rows is None and expert_format == "mxfp4":
        raise ConfigError(f"{folder} holds no MXFP4 experts the engine can keep in 4 bits (gpt-oss's published "
                          f"checkpoints do): use --expert-format auto or dense")
    return rows


def _check_packed(folder: Path, index: dict, stored: torch.dtype, dtype: torch.dtype) -> None:
    """``check_host_memory`` for a packed folder's bank, unless it is mapped from its files (a CPU
    machine's restart reads it into the page cache, which the kernel can take back)."""
    from .. import env
    from ..packed.format import bank_layers, bank_mxfp4
    bank = index.get("bank")
    if not bank or (dtype == stored and not torch.cuda.is_available() and env.map_bank()):
        return
    four = bank_mxfp4(bank)
    need = ExpertBank.nbytes_for(bank_layers(bank), bank["num_experts"], bank["hidden"], bank["inter"], dtype, four)
    if not four and dtype != stored:            # read as stored, then converted
        need += need // dtype.itemsize * stored.itemsize
    check_host_memory(folder, need, "its expert bank")


def _hf_store(fam, ckpt, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``bank_store`` for a Hugging Face folder, by the dtype its first expert is read in (only
    where that can matter, and not where the weights are scaled as they are read)."""
    if device.type != "cpu" or dtype != torch.float32 or cfg.residual_multiplier != 1.0:
        return dtype
    m = cfg.moe
    return bank_store(dtype, device, fam.expert_dtype(ckpt, m.layers[0]) if m.num_experts else None)


def _dequantized(ckpt, tensors: tuple, cfg: ModelConfig, dtype: torch.dtype) -> ExpertBank:
    """A dense bank of a packed folder's 4-bit one (read whole first), a layer at a time."""
    from ..kernels.mxfp4 import dequantize
    ckpt.finish()
    m = cfg.moe
    bank = ExpertBank(cfg.bank_layers, m.num_experts, cfg.hidden_size, m.intermediate_size, dtype)
    for layer in range(cfg.bank_layers):
        bank.w13[layer].copy_(dequantize(tensors[0][layer], dtype))
        bank.w2[layer].copy_(dequantize(tensors[1][layer], dtype))
    bank.pin()
    return bank


def _build(folder: Path, ckpt, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
           progress: Progress | None, expert_format: str = "auto") -> tuple[DecoderLM, ExpertBank | None, ModelConfig,
                                                                            BankRead]:
    fam = family(cfg.model_type)
    rotary = Rotary(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, device)
    with torch.device("meta"), no_init():
        model = DecoderLM(cfg, rotary).to(dtype)       # cast while still free: no fp32 pass
    # Module.to_empty would call empty_like on meta tensors, whose reference path imports sympy.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    params = dict(model.named_parameters())
    tied = cfg.tie_word_embeddings or not ckpt.has(fam.lm_head)
    wanted = [k for k in params if not (tied and k == "lm_head.weight")]
    by_engine_name = {fam.rename(k): k for k in ckpt.names()}
    # bfloat16 projections stay bfloat16 on a CPU computing in float32 (the same values: bank_store)
    narrow = model.narrowable(tied) if device.type == "cpu" and dtype == torch.float32 else set()
    bank = None
    packed = hasattr(ckpt, "bank_tensors")
    packed_read = ckpt if packed else None      # what the caller's BankRead still waits for
    # 4-bit experts dequantized: asked for, or auto on a GPU that holds them all dense
    dense = expert_format == "dense" or (expert_format == "auto" and auto_dense(cfg, dtype, device))
    first_rows = None if packed else _expert_rows(fam, ckpt, cfg, dense, expert_format, folder)
    if cfg.moe:
        m = cfg.moe
        try:
            tensors = ckpt.bank_tensors() if packed else ()
            if packed and tensors[0].shape[0] > cfg.bank_layers:   # an MTP layer packed, not run here
                tensors = tuple(t[:cfg.bank_layers] for t in tensors)
            four = tensors[0].dtype == torch.uint8 if packed else first_rows is not None
            if packed and not four and expert_format == "mxfp4":
                raise ConfigError(f"packed folder {folder} holds its experts dense: --expert-format mxfp4 needs "
                                  f"a checkpoint with MXFP4 experts (or a folder converted from one)")
            if packed and four and dense:
                bank = _dequantized(ckpt, tensors, cfg, dtype)
                packed_read, four = None, False
            else:
                store = tensors[0].dtype if packed else _hf_store(fam, ckpt, cfg, dtype, device) if not four else None
                if not packed:
                    # the other weights in host memory (a CPU's), the narrowed ones by the experts' dtype
                    dense = sum(params[k].numel() * (2 if k in narrow and store == torch.bfloat16
                                                     else params[k].element_size())
                                for k in wanted) if device.type == "cpu" else 0
                    check_host_memory(folder, dense + ExpertBank.nbytes_for(cfg.bank_layers, m.num_experts, cfg.hidden_size,
                                                                            m.intermediate_size, store or dtype, four),
                                      "its expert bank" + (" and other weights" if dense else ""))
                bank = ExpertBank(cfg.bank_layers, m.num_experts, cfg.hidden_size, m.intermediate_size, dtype,
                                  *tensors, mxfp4=four, store=store)
            if four and device.type == "cuda":
                why = "as asked" if expert_format == "mxfp4" else "dense they would not all fit"
                log.info(f"experts kept in MXFP4 on the GPU ({why}): the cache holds 3.8x as many and fills move "
                         f"3.8x fewer bytes; --expert-format dense dequantizes them")
        except ValueError as exc:
            raise ConfigError(f"packed checkpoint {folder}: {exc}") from None
    total = len(wanted) + (bank.total_experts if bank and not packed else 0)
    done = 0
    with torch.no_grad():
        for name in wanted:
            how = fam.source(cfg, name) if fam.source is not None else None
            src = by_engine_name.get(how[0] if how else name)
            if src is None:
                raise ConfigError(f"checkpoint {folder} lacks tensor for {name}")
            t = ckpt.get(src) if how is None else how[1](ckpt.get(src))
            if cfg.residual_multiplier != 1.0 and _BRANCH_END.search(name):
                t = t * cfg.residual_multiplier
            if t.shape != params[name].shape:
                raise ConfigError(f"tensor {src} has shape {tuple(t.shape)}, config implies {tuple(params[name].shape)}")
            if name in narrow and t.dtype == torch.bfloat16:
                params[name] = model.narrow(name)
            params[name].copy_(t)
            done += 1
            if progress and not packed and done % 16 == 0:   # a packed folder's progress is its read
                progress(done / total)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        if not packed and bank is not None:
            layers = [*cfg.moe.layers, *([fam.mtp_layer(cfg)] if cfg.use_mtp else [])]
            for li, layer in enumerate(layers):
                if bank.mxfp4:
                    rows = first_rows if li == 0 else fam.layer_expert_rows(ckpt, layer, cfg.moe.num_experts,
                                                                            (bank.hidden, bank.inter))
                    if rows is None:
                        raise ConfigError(f"layer {layer}'s experts are not MXFP4 as the first layer's are: "
                                          f"use --expert-format dense")
                    for e, (w13, w2) in enumerate(rows):
                        bank.w13[li, e].copy_(w13)
                        bank.w2[li, e].copy_(w2)
                        done += 1
                    if progress:
                        progress(done / total)
                    continue
                for e, (gate, up, down) in enumerate(fam.layer_experts(ckpt, layer, cfg.moe.num_experts,
                                                                            (bank.hidden, bank.inter),
                                                                            cfg.residual_multiplier)):
                    if gate.shape != (bank.inter, bank.hidden) or down.shape != (bank.hidden, bank.inter):
                        raise ConfigError(f"expert {e} of layer {layer} has shape {tuple(gate.shape)}, "
                                          f"config implies {(bank.inter, bank.hidden)}")
                    if bank.store != bank.dtype and {gate.dtype, up.dtype, down.dtype} != {bank.store}:
                        bank = bank.widened()     # stored wider than the first expert: keep them exact
                    bank.fill(li, e, gate, up, down)
                    done += 1
                if progress:
                    progress(done / total)
            bank.pin()
    if packed:
        ckpt.release_dense()            # copied: the bank alone is still being read
    else:
        ckpt.close()
    for module in model.modules():
        if hasattr(module, "fuse"):
            module.fuse()
    model.eval()
    if packed and packed_read is None:
        ckpt.close()                    # its 4-bit bank was read and dequantized: nothing is pending
    return model, bank, cfg, BankRead(packed_read, bank)
