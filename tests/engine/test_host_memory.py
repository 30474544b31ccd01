"""A model whose expert bank cannot fit in the host memory this machine has free is refused
before anything is read, in one line that says how much it needs and how much there is; one
that fits only by swapping starts with a warning. (The machine's memory is the one thing faked
here: a tiny checkpoint needs a few MB.)"""
from __future__ import annotations

import logging

import pytest

from freetoken_engine import LLM
from freetoken_engine.errors import ConfigError
from freetoken_engine.models import build
import test_cli

KB = 1 << 10
cli_error = test_cli.cli_error       # the fixture: freetoken's one-line errors


def test_a_bank_that_cannot_fit_is_refused_before_it_is_read(tiny_checkpoint, monkeypatch):
    folder = tiny_checkpoint("qwen3_moe")
    monkeypatch.setattr(build, "host_memory", lambda: (KB, KB))
    made = []
    real = build.ExpertBank.__init__
    monkeypatch.setattr(build.ExpertBank, "__init__", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    with pytest.raises(ConfigError, match=r"needs \d+\.\d MB of host memory \(its expert bank and other weights\); "
                                          r"this machine has 0\.0 MB available and 0\.0 MB of free swap"):
        LLM(folder)
    assert made == []


def test_what_fits_only_in_swap_starts_with_a_warning(tiny_checkpoint, monkeypatch, caplog):
    folder = tiny_checkpoint("qwen3_moe")
    monkeypatch.setattr(build, "host_memory", lambda: (KB, 1 << 40))
    with caplog.at_level(logging.WARNING):
        llm = LLM(folder)
    assert "it will swap" in caplog.text
    assert llm.generate([5, 6, 7]).token_ids


def test_a_packed_bank_read_into_memory_is_checked_and_a_mapped_one_is_not(tiny_checkpoint, tmp_path, monkeypatch):
    """A CPU machine's packed folder is mapped from its files (page cache the kernel can take
    back): only the read into anonymous memory (mapping off, a GPU's pinned bank) is checked."""
    from freetoken_engine.packed import convert
    packed = convert(tiny_checkpoint("qwen3_moe"), tmp_path / "packed", progress=False)
    monkeypatch.setattr(build, "host_memory", lambda: (KB, 0))
    LLM(packed)
    monkeypatch.setenv("FREETOKEN_MAP_BANK", "off")
    with pytest.raises(ConfigError, match=r"needs \d+\.\d MB of host memory \(its expert bank\)"):
        LLM(packed)


def test_the_cli_says_it_in_one_line(tiny_checkpoint, monkeypatch, cli_error):
    monkeypatch.setattr(build, "host_memory", lambda: (KB, 0))
    err = cli_error("generate", "--model", str(tiny_checkpoint("qwen3_moe")), "--prompt-ids", "1,2")
    assert "MB of host memory" in err and "free memory or run a smaller model" in err


def test_the_bank_size_is_what_the_bank_holds(tiny_checkpoint):
    bank = LLM(tiny_checkpoint("qwen3_moe")).runner.bank
    assert build.ExpertBank.nbytes_for(bank.num_layers, bank.num_experts, bank.hidden, bank.inter,
                                       bank.w13.dtype) == bank.w13.nbytes + bank.w2.nbytes


def _checkpoint_bytes(folder) -> int:
    """Bytes of every tensor a checkpoint folder stores (float32 or bfloat16)."""
    from safetensors import safe_open
    total = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                total += _numel(t.get_shape()) * (2 if t.get_dtype() == "BF16" else 4)
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_the_memory_counted_is_what_the_checkpoint_holds(tiny_checkpoint, tmp_path, monkeypatch):
    """A float32 checkpoint's bank and other weights are counted once each (a tied LM head not
    at all); a bfloat16 one's narrowed weights at two bytes, its norms and routers at four."""
    from test_bank_store import bf16_copy
    needs = []
    real = build.check_host_memory
    monkeypatch.setattr(build, "check_host_memory", lambda folder, need, what: needs.append(need) or real(folder, need, what))
    for model_type in ("qwen3_moe", "granitemoe"):
        src = tiny_checkpoint(model_type)
        LLM(src)
        assert needs.pop() == _checkpoint_bytes(src), model_type
    narrow = bf16_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "bf16")
    LLM(narrow)
    assert _checkpoint_bytes(narrow) < needs.pop() < 0.6 * _checkpoint_bytes(tiny_checkpoint("qwen3_moe"))
