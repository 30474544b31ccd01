"""A CPU engine's restart maps the packed bank's files (``early.Fill(mapped=True)``): the page
cache becomes the bank, with the same bytes as a read, the same tokens from the engine, and
``FREETOKEN_MAP_BANK=off`` or a first start (its CRC pass) reading as before."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import copy_folder

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.packed import early, load_packed, preload

pytestmark = pytest.mark.skipif(not early.can_map(), reason="needs MADV_POPULATE_READ (Linux 5.14+)")


def _mapped_files(t: torch.Tensor) -> set[str]:
    """Names of the files mapped over ``t``'s bytes (/proc/self/maps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start < hi and end > lo and len(parts) >= 6 and parts[5].startswith("/"):
            names.add(Path(parts[5]).name)
    return names


def _bank_bytes(pm) -> int:
    return pm.w13.numel() * pm.w13.element_size() + pm.w2.numel() * pm.w2.element_size()


def test_a_restart_maps_the_bank_with_the_bytes_a_read_gives(tiny_packed, tmp_path, monkeypatch):
    folder = copy_folder(tiny_packed[1], tmp_path / "m")
    first = load_packed(folder, pin="none")                 # the first load checks every CRC: a read
    assert first.stats["verified"] and first.stats["mapped_bytes"] == 0
    again = load_packed(folder, pin="none")
    assert not again.stats["verified"] and again.stats["mapped_bytes"] == _bank_bytes(again)
    assert torch.equal(again.w13, first.w13) and torch.equal(again.w2, first.w2)
    for key in again.names():
        assert torch.equal(again.get(key), first.get(key)), key
    assert {f.name for f in folder.glob("bank-w13-*")} == _mapped_files(again.w13)
    assert not _mapped_files(first.w13)                    # anonymous memory
    monkeypatch.setenv("FREETOKEN_MAP_BANK", "off")
    off = load_packed(folder, pin="none")
    assert off.stats["mapped_bytes"] == 0 and not _mapped_files(off.w13)
    assert torch.equal(off.w13, first.w13)


def test_a_cpu_preload_maps_and_the_load_takes_it_over(tiny_packed, tmp_path):
    folder = copy_folder(tiny_packed[1], tmp_path / "m")
    want = load_packed(folder, pin="none")                  # verifies the copy
    preload(folder, threads=2, device="cuda")               # a GPU engine's bank is read, to be pinned
    gpu = load_packed(folder, pin="none")
    assert gpu.stats["preloaded"] and gpu.stats["mapped_bytes"] == 0
    preload(folder, threads=2, device="cpu")
    pm = load_packed(folder, pin="none")
    assert pm.stats["preloaded"] and pm.stats["mapped_bytes"] == _bank_bytes(pm)
    assert torch.equal(pm.w13, want.w13) and torch.equal(pm.w2, want.w2)


def test_a_restarted_engine_on_a_mapped_bank_answers_as_the_first_start(tiny_packed, tmp_path):
    """Whole bank on the CPU, and a small expert cache whose fills copy rows out of the mapping."""
    src, packed = tiny_packed
    folder = copy_folder(packed, tmp_path / "m")
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompt = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9]
    want = LLM(src).generate(prompt, greedy).token_ids
    first = LLM(folder)
    assert first.generate(prompt, greedy).token_ids == want and not _mapped_files(first.runner.bank.w13)
    for options in ({}, {"expert_cache_experts": 3, "cpu_expert_fraction": 0.5}):
        again = LLM(folder, **options)
        assert _mapped_files(again.runner.bank.w13)
        assert again.generate(prompt, greedy).token_ids == want, options


TWO_CPUS_CLI = r"""
import json, os, sys
os.sched_getaffinity = lambda pid: {0, 1}              # a 2-CPU machine
import freetoken_engine.packed as packed
from freetoken_engine.packed import early
seen = {}
real = early.preload
def preload(folder, threads=8, device=None, **kw):
    started = real(folder, threads, device, **kw)
    if started:
        seen["preloaded"], seen["torch"] = True, "torch" in sys.modules
    return started
packed.preload = early.preload = preload
from freetoken_engine.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, **seen}))
"""


def test_on_two_cpus_the_cli_reads_early_only_a_restart_it_maps(tiny_packed, tmp_path):
    """On 2 CPUs an early read's page faults take the CPU the imports need, so the CLI does not
    read early by default; a mapped read costs them nothing, so a restart of a verified folder is
    read early (before torch), and its first start is not."""
    import json
    import os
    import subprocess
    import sys
    folder = copy_folder(tiny_packed[1], tmp_path / "m")
    args = ["generate", "--model", str(folder), "--prompt-ids", "5,17,99,200", "--max-new-tokens", "2", "--json"]
    env = {k: v for k, v in os.environ.items() if k not in ("FREETOKEN_PRELOAD", "FREETOKEN_MAP_BANK")}

    def cli(**extra):
        r = subprocess.run([sys.executable, "-c", TWO_CPUS_CLI, *args], capture_output=True, text=True,
                           timeout=300, env={**env, **extra})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert cli() == {"rc": 0}                                        # first start: verified, not early
    assert cli() == {"rc": 0, "preloaded": True, "torch": False}     # restart: mapped, early
    assert cli(FREETOKEN_MAP_BANK="off") == {"rc": 0}


def test_a_write_into_a_mapped_bank_stays_in_the_process(tiny_packed, tmp_path):
    """The engine never writes its bank, but a mapped one must not crash or change the file if
    something does: the write copies the page (a private mapping)."""
    folder = copy_folder(tiny_packed[1], tmp_path / "m")
    load_packed(folder, pin="none")
    pm = load_packed(folder, pin="none")
    assert pm.stats["mapped_bytes"] > 0
    before = [f.read_bytes() for f in sorted(folder.glob("bank-*"))]
    pm.w13.fill_(1.5)
    assert bool((pm.w13 == 1.5).all())
    assert [f.read_bytes() for f in sorted(folder.glob("bank-*"))] == before
    assert load_packed(folder, pin="none").stats["verified"] is False      # the files are unchanged
