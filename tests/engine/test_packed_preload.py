"""``preload``: a packed folder's read starts before torch is imported and the load takes it over,
with the same bytes as a plain load; its failures surface from the load; a load asking for other
options reads again; ``freetoken generate`` starts it before torch. ``defer_bank``: the load
returns with the dense files in and the bank finishing behind the model's construction."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from procs import python_json
from tiny_models import copy_folder, gate_bank_reads, scale_config

from freetoken_engine.packed import PackedFormatError, load_packed, preload
from freetoken_engine import LLM
from freetoken_engine.packed import early


def _flip(path: Path, at: int, keep_stamp: bool) -> None:
    """Corrupt one byte in place; with keep_stamp the file keeps its size, mtime and inode."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x20]))
    if keep_stamp:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_preloaded_read_is_taken_over_and_loads_the_same_bytes(tiny_packed):
    _, out = tiny_packed
    plain = load_packed(out, threads=2)
    preload(out, threads=3)
    seen: list[float] = []
    pm = load_packed(out, threads=2, progress=seen.append)
    assert pm.stats["preloaded"] is True and plain.stats["preloaded"] is False
    assert early.take(out) is None                          # taken, not left behind
    assert torch.equal(pm.w13, plain.w13) and torch.equal(pm.w2, plain.w2)
    assert pm.names() == plain.names()
    for key in pm.names():
        assert torch.equal(pm.get(key), plain.get(key)), key
    assert pm.w13.data_ptr() % 4096 == 0
    assert pm.stats["bytes"] == plain.stats["bytes"]
    assert all(0 < f <= 1 for f in seen)                    # progress of what was left, if anything


def test_preloaded_read_converts_to_the_asked_dtype(tiny_packed):
    _, out = tiny_packed
    want = load_packed(out)
    preload(out)
    half = load_packed(out, dtype=torch.bfloat16)
    assert half.stats["preloaded"] and half.w13.dtype == torch.bfloat16
    assert torch.equal(half.w13, want.w13.to(torch.bfloat16)) and torch.equal(half.w2, want.w2.to(torch.bfloat16))


def test_preload_starts_before_torch_is_imported(tiny_packed):
    _, out = tiny_packed
    code = ("import json, sys\n"
            "import freetoken_engine\n"
            f"freetoken_engine.preload({str(out)!r})\n"
            "before = 'torch' in sys.modules\n"
            "from freetoken_engine.packed import load_packed\n"
            f"pm = load_packed({str(out)!r})\n"
            "print(json.dumps({'torch_before': before, 'preloaded': pm.stats['preloaded'],\n"
            "                  'sum': float(pm.w13.double().sum())}))\n")
    got = python_json(code, timeout=120)
    assert got["torch_before"] is False and got["preloaded"] is True
    assert got["sum"] == float(load_packed(out).w13.double().sum())


def test_a_corrupt_block_found_by_the_preload_fails_the_load(tiny_packed, tmp_path):
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "bad")                      # never loaded: every block is checked
    _flip(bad / "bank-w2-00001.bin", 10, keep_stamp=False)
    preload(bad)
    with pytest.raises(PackedFormatError, match=r"bank-w2-00001\.bin: block 0 .*CRC32"):
        load_packed(bad)
    assert early.take(bad) is None


def test_a_load_with_other_options_reads_again(tiny_packed, tmp_path):
    """A restart's preload skips the CRC pass (files unchanged since a checked load); a load that
    asks for verify=True must not take that read over: it reads again and catches the damage."""
    _, out = tiny_packed
    folder = copy_folder(out, tmp_path / "stamped")
    assert load_packed(folder).stats["verified"] is True
    _flip(folder / "bank-w13-00000.bin", 123, keep_stamp=True)  # the stamp still says verified
    preload(folder)
    with pytest.raises(PackedFormatError, match="CRC32"):
        load_packed(folder, verify=True)
    preload(folder)
    assert load_packed(folder).stats["preloaded"] is True    # the same options: taken over


def test_deferred_bank_finishes_to_the_same_bytes(tiny_packed):
    _, out = tiny_packed
    plain = load_packed(out)
    pm = load_packed(out, defer_bank=True)
    for key in plain.names():
        assert torch.equal(pm.get(key), plain.get(key)), key     # the dense files are in at once
    pm.finish()
    pm.finish()                                                   # once is enough; twice is harmless
    assert torch.equal(pm.w13, plain.w13) and torch.equal(pm.w2, plain.w2)
    assert pm.stats["read_seconds"] > 0 and pm.stats["seconds"] >= pm.stats["read_seconds"]


def test_building_from_a_packed_folder_reports_its_read(tiny_packed):
    """The server's /health shows build_model's progress while loading: for a packed folder it
    is the fraction of its bytes read, rising, never past 0.99 (the service says 1.0 when ready)."""
    from freetoken_engine.models.build import build_model
    _, out = tiny_packed
    seen: list[float] = []
    build_model(out, torch.float32, torch.device("cpu"), progress=seen.append)
    assert len(seen) >= 3 and seen == sorted(seen)
    assert 0 < seen[0] < 0.5 and seen[-1] == pytest.approx(0.99)


def test_a_corrupt_bank_fails_the_deferred_load(tiny_packed, tmp_path):
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "bad-bank")
    _flip(bad / "bank-w13-00001.bin", 77, keep_stamp=False)
    with pytest.raises(PackedFormatError, match=r"bank-w13-00001\.bin: block 0 .*CRC32"):
        load_packed(bad, defer_bank=True).finish()


def test_a_model_that_fails_to_build_stops_its_bank_read(tiny_packed, tmp_path, monkeypatch):
    """build_model defers the bank; when the dense weights do not fit the config it fails with a
    clear error and leaves no reader thread behind (bank blocks slowed down to 0.3 s each, so
    the read is still going when the error comes)."""
    import time
    from freetoken_engine.errors import ConfigError
    from freetoken_engine.models.build import build_model
    read = early.Fill._read

    def slow_read(self, name, *rest):
        if name.startswith("bank-"):
            time.sleep(0.3)
        read(self, name, *rest)
    monkeypatch.setattr(early.Fill, "_read", slow_read)
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "bad-heads")
    scale_config(bad, "num_attention_heads", 2)
    with pytest.raises(ConfigError, match="has shape"):
        build_model(bad, torch.float32, torch.device("cpu"))
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-fill")]


def test_a_file_can_be_waited_for_while_the_rest_is_read(tiny_packed, monkeypatch):
    """The loader pins each bank piece as its file lands: ``wait_file`` returns once that file is
    in, with others still reading, and raises once the read failed."""
    from freetoken_engine.packed.format import read_index
    _, out = tiny_packed
    gate = gate_bank_reads(monkeypatch, "bank-w2-")
    index = read_index(out)
    fill = early.Fill(out, index, True, True, 4)
    names = [job[0] for job in fill.jobs]
    last_w13 = max(i for i, n in enumerate(names) if n.startswith("bank-w13-"))
    assert last_w13 < min(i for i, n in enumerate(names) if n.startswith("bank-w2-"))   # pinned first
    fill.start()
    try:
        fill.wait_file("bank-w13-00001.bin")              # in, while the w2 pieces wait at the gate
        assert not fill._file_done["bank-w2-00001.bin"].is_set()
    finally:
        gate.set()
    fill.wait()
    assert all(e.is_set() for e in fill._file_done.values())
    fill = early.Fill(out, index, True, True, 4).start()
    fill.cancel()
    with pytest.raises(PackedFormatError, match="cancelled"):
        fill.wait_file("bank-w2-00001.bin")


def test_an_engine_start_that_fails_after_the_build_stops_its_bank_read(tiny_packed, monkeypatch):
    """The engine builds its cache and KV pool while the bank is still read; a failure there
    leaves no reader thread behind (bank reads held at a gate until the error came)."""
    from freetoken_engine.cache import kv
    gate = gate_bank_reads(monkeypatch)

    def no_memory(*args, **kwargs):
        gate.set()                          # released only now: the read is still going
        raise MemoryError("no room for the KV pool")
    monkeypatch.setattr(kv.KVPool, "__init__", no_memory)
    fills, start = [], early.Fill.start

    def recorded(self):
        fills.append(self)
        return start(self)
    monkeypatch.setattr(early.Fill, "start", recorded)
    _, out = tiny_packed
    with pytest.raises(MemoryError):
        LLM(out)
    assert len(fills) == 1 and fills[0].cancelled and not fills[0].fds    # stopped, files closed
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-fill")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs an engine start that fails: no CUDA here")
def test_an_engine_that_fails_to_start_drops_the_preloaded_read(tiny_packed):
    """A server whose engine cannot start (here --device cuda without a GPU) stays up to say why
    on /health; the bank its CLI preloaded must not stay in its memory."""
    from freetoken_engine.errors import ConfigError
    _, out = tiny_packed
    preload(out)
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        LLM(out, device="cuda")
    assert early.take(out) is None


CLI_PROBE = r"""
import json, sys
import freetoken_engine.packed as packed
from freetoken_engine.packed import early, early_cuda
seen = {"context": []}
real_start = early_cuda.start
def start(device):
    seen["context"].append([device, "torch" in sys.modules])
    return real_start(device)
early_cuda.start = start
real_preload, real_take = early.preload, early.take
def preload(folder, threads=8, device=None, **kw):
    seen["torch_at_preload"], seen["device"] = "torch" in sys.modules, device
    return real_preload(folder, threads, device, **kw)
def take(folder):
    fill = real_take(folder)
    seen["taken"] = fill is not None
    return fill
packed.preload = early.preload = preload
early.take = take
from freetoken_engine.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, **seen}))
"""


def test_cli_generate_starts_the_read_before_torch(tiny_packed):
    src, out = tiny_packed
    args = ["generate", "--model", str(out), "--prompt-ids", "5,17,99,200", "--max-new-tokens", "4", "--json"]
    r = subprocess.run([sys.executable, "-c", CLI_PROBE, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "FREETOKEN_PRELOAD": "on"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    probe = json.loads(lines[-1])
    assert probe == {"rc": 0, "torch_at_preload": False, "device": "cpu", "taken": True,
                     "context": [["cpu", False], ["cpu", False]]}         # by preload, then the CLI (once)
    got = json.loads(lines[-2])["token_ids"]
    from freetoken_engine import SamplingParams
    assert got == LLM(src).generate([5, 17, 99, 200], SamplingParams(max_new_tokens=4, temperature=0)).token_ids


def test_cli_starts_the_cuda_context_before_torch_for_any_model(tiny_checkpoint):
    """A Hugging Face folder is not preloaded, but its engine's device context is still asked for
    before torch is imported (a CPU device here: nothing is made, see test_early_cuda.py)."""
    args = ["generate", "--model", str(tiny_checkpoint("qwen3_moe")), "--prompt-ids", "5,17", "--max-new-tokens", "2"]
    r = subprocess.run([sys.executable, "-c", CLI_PROBE, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "FREETOKEN_PRELOAD": "on"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"rc": 0, "context": [["cpu", False]]}


@pytest.mark.parametrize("cpus,setting,want", [(2, None, False), (4, None, True), (16, "auto", True),
                                               (2, "on", True), (16, "off", False)])
def test_the_cli_preloads_by_default_only_with_cpus_to_spare(monkeypatch, cpus, setting, want):
    """On 2 CPUs a cold restart with the early read measured 0.84-0.91x (its page faults take the
    CPU the imports need), with 16 CPUs 1.09-1.45x: "auto" reads early from 4 CPUs on."""
    from freetoken_engine import env
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    if setting is None:
        monkeypatch.delenv("FREETOKEN_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("FREETOKEN_PRELOAD", setting)
    assert env.preload() is want


def test_cli_with_a_truncated_packed_folder_is_one_line(tiny_packed, tmp_path):
    """The CLI's preload meets the damage first; the error still comes once, from the load, as
    one line and exit 2 (a server reports it on /health the same way as before)."""
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "trunc-cli")
    f = bad / "bank-w2-00000.bin"
    f.write_bytes(f.read_bytes()[:-4096])
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--model", str(bad),
                        "--prompt-ids", "1,2", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "bytes on disk" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_preload_reads_the_small_files_before_the_bank_reads_start(tiny_packed, tmp_path, monkeypatch):
    _, out = tiny_packed
    folder = copy_folder(out, tmp_path / "p")
    (folder / "notes.bin").write_bytes(b"\0" * 4096)          # not in the index: read too
    (folder / "extras").mkdir()                                  # neither a folder ...
    (folder / "gone.json").symlink_to(folder / "deleted.json")   # ... nor a dangling link stops it
    order = []
    read = early.read_small_files
    monkeypatch.setattr(early, "read_small_files", lambda *a: order.append(("small", read(*a))))
    start = early.Fill.start
    monkeypatch.setattr(early.Fill, "start", lambda self: order.append(("bank", None)) or start(self))
    preload(folder)
    assert [k for k, _ in order] == ["small", "bank"]          # queued on the disk after them
    names = order[0][1]
    assert {"config.json", "tokenizer.json", "generation_config.json", "notes.bin"} <= set(names)
    assert not any(n.startswith(("bank-", "dense-")) or n == "freetoken-packed.json" for n in names)
    assert load_packed(folder).stats["preloaded"]


def test_small_files_past_the_budget_are_left_to_the_start(tiny_packed):
    _, out = tiny_packed
    index = json.loads((out / "freetoken-packed.json").read_text())
    sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.name not in index["files"]}
    smallest = min(sizes.values())
    got = early.read_small_files(out, index, limit=smallest)
    assert len(got) == 1 and sizes[got[0]] == smallest
