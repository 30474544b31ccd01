"""The packed fast-start format: convert a real (tiny, transformers-written) checkpoint, load it
back bit for bit, and fail clearly on corrupt, truncated or mismatched folders."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from tiny_models import copy_folder, scale_config

from freetoken_engine.models import family
from freetoken_engine.models.loader import Checkpoint
from freetoken_engine.packed import PackedFormatError, convert, early, is_packed, load_packed, preload


def test_packed_folder_stands_alone_and_loads_bit_exact(tiny_packed):
    src, out = tiny_packed
    assert is_packed(out) and not is_packed(src)
    others = {f.name for f in src.iterdir() if not f.name.endswith(".safetensors")} - {"model.safetensors.index.json"}
    assert others <= {f.name for f in out.iterdir()}       # config, tokenizer, template copied
    assert "tokenizer.json" in others and "config.json" in others
    seen: list[float] = []
    pm = load_packed(out, threads=3, progress=seen.append)
    assert seen and seen[-1] == 1.0 and seen == sorted(seen)  # progress reaches 100%, never goes back
    ckpt = Checkpoint(src)
    fam = family(ckpt.config["model_type"])
    moe = fam.parse(ckpt.config).moe
    expert_keys = {fam.expert_key(layer, e, p) for layer in moe.layers for e in range(moe.num_experts) for p in range(3)}
    assert set(pm.names()) == set(ckpt.names()) - expert_keys
    for key in pm.names():
        assert torch.equal(pm.get(key), ckpt.get(key)), key
    I = moe.intermediate_size
    assert pm.w13.shape == (len(moe.layers), moe.num_experts, 2 * I, ckpt.config["hidden_size"])
    assert pm.w13.data_ptr() % 4096 == 0 and pm.w2.data_ptr() % 4096 == 0
    for li, layer in enumerate(moe.layers):
        for e in range(moe.num_experts):
            gate, up, down = (ckpt.get(fam.expert_key(layer, e, p)) for p in range(3))
            assert torch.equal(pm.w13[li, e, :I], gate) and torch.equal(pm.w13[li, e, I:], up)
            assert torch.equal(pm.w2[li, e], down)
    assert pm.stats["bytes"] == sum(m["size"] for m in pm.index["files"].values())
    assert len(pm.index["bank"]["pieces"]) == 2 * len(moe.layers)


def test_bank_dtype_conversion_on_load(tiny_packed):
    _, out = tiny_packed
    full = load_packed(out)
    half = load_packed(out, dtype=torch.bfloat16, pin="none")
    assert half.w13.dtype == torch.bfloat16
    assert torch.equal(half.w13, full.w13.to(torch.bfloat16)) and torch.equal(half.w2, full.w2.to(torch.bfloat16))


def test_corrupt_block_is_caught_by_its_checksum(tiny_packed, tmp_path):
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "bad")
    victim = bad / "bank-w2-00001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(PackedFormatError, match=r"bank-w2-00001\.bin: block 0 .*CRC32"):
        load_packed(bad)
    assert load_packed(bad, verify=False).w2 is not None     # unverified loads do not check


def test_restart_skips_the_checksum_pass_until_a_file_changes(tiny_packed, tmp_path):
    """verify="auto": the first load checks every block, a restart of unchanged files does not,
    and a file rewritten since (new mtime) is checked again and caught."""
    _, out = tiny_packed
    folder = copy_folder(out, tmp_path / "restart")
    assert load_packed(folder).stats["verified"] is True
    assert load_packed(folder).stats["verified"] is False
    victim = folder / "bank-w13-00000.bin"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(PackedFormatError, match="CRC32"):
        load_packed(folder)


def test_truncated_or_missing_files_fail_before_loading(tiny_packed, tmp_path):
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "trunc")
    f = bad / "bank-w13-00000.bin"
    f.write_bytes(f.read_bytes()[:-4096])
    with pytest.raises(PackedFormatError, match="bytes on disk"):
        preload(bad)                    # the early read checks first too, and starts nothing
    assert early.take(bad) is None
    with pytest.raises(PackedFormatError, match="bytes on disk"):
        load_packed(bad)
    f.unlink()
    with pytest.raises(PackedFormatError, match="missing packed file bank-w13-00000.bin"):
        load_packed(bad)


def test_config_that_does_not_match_the_bank_is_rejected(tiny_packed, tmp_path):
    _, out = tiny_packed
    bad = copy_folder(out, tmp_path / "mismatch")
    scale_config(bad, "moe_intermediate_size", 2)
    with pytest.raises(PackedFormatError, match="does not match config.json"):
        load_packed(bad)


def test_convert_refuses_a_non_empty_output(tiny_checkpoint, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(PackedFormatError, match="not empty"):
        convert(tiny_checkpoint("qwen3_moe"), tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_convert_says_what_is_wrong_with_a_packed_source_or_an_unwritable_output(tiny_checkpoint, tmp_path):
    """A packed folder as the source is named as such (was: 'holds no *.safetensors weights'),
    and an output folder that cannot be made names the folder, not a hidden temporary one."""
    packed = convert(tiny_checkpoint("qwen3_moe"), tmp_path / "packed", progress=False)
    with pytest.raises(PackedFormatError, match="is already a packed folder"):
        convert(packed, tmp_path / "again", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(PackedFormatError, match=f"cannot write the output folder {tmp_path}/file/out: "):
        convert(tiny_checkpoint("qwen3_moe"), tmp_path / "file" / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "packed"]


def test_cli_convert_writes_a_loadable_folder(tiny_checkpoint, tmp_path):
    out = tmp_path / "cli-packed"
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "convert",
                        "--model", str(tiny_checkpoint("qwen3_moe")), "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert load_packed(out).w13 is not None


def test_a_model_without_experts_packs_and_serves_the_same_tokens(tiny_checkpoint, tmp_path):
    """A dense model (no expert bank) packs too; loading it, plain or read early by ``preload``,
    gives the Hugging Face folder's tokens."""
    from freetoken_engine import LLM, SamplingParams
    src = tiny_checkpoint("llama")
    out = tmp_path / "dense-packed"
    convert(src, out, progress=False)
    pm = load_packed(out)
    assert pm.w13 is None and pm.stats["pin_seconds"] == 0.0
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(src).generate([5, 17, 99], params).token_ids
    assert LLM(out).generate([5, 17, 99], params).token_ids == want
    preload(out)
    assert LLM(out).generate([5, 17, 99], params).token_ids == want


@pytest.mark.gpu
def test_pinned_bank_reloads_and_copies_exactly(tiny_packed):
    """Pin after fill, free, load again in the same process: the old registration is undone
    (no 'already registered'), and a host-to-device copy of the pinned bank is exact."""
    _, out = tiny_packed
    first = load_packed(out, pin="after")
    assert first.pinned
    expect = first.w13.clone()
    del first
    again = load_packed(out, pin="after")
    assert again.pinned
    assert torch.equal(again.w13.to("cuda", non_blocking=True).cpu(), expect)


def test_spans_of_blocks_read_the_same_bytes_in_fewer_reads_and_check_every_block(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch):
    """A folder written with 4 KiB CRC blocks, so that one read (a span of ``early.SPAN`` blocks)
    holds several: the bytes equal a block-at-a-time read's, with about SPAN times fewer preadv
    calls (each a trip through the GIL while the imports run beside the read), and a corrupt
    block inside a span is still found and named."""
    from freetoken_engine.packed import writer
    monkeypatch.setattr(writer, "BLOCK", 4096)
    out = tmp_path / "small-blocks"
    convert(tiny_checkpoint("qwen3_moe"), out, progress=False)
    reads = []
    real = early.os.preadv
    monkeypatch.setattr(early.os, "preadv", lambda fd, bufs, off: reads.append(1) or real(fd, bufs, off))
    by_span = {}
    for span in (1, early.SPAN):
        monkeypatch.setattr(early, "SPAN", span)
        reads.clear()
        by_span[span] = (load_packed(out, verify=True), len(reads))
    (one, n1), (many, n4) = by_span[1], by_span[early.SPAN]
    assert torch.equal(one.w13, many.w13) and torch.equal(one.w2, many.w2)
    assert all(torch.equal(one.get(k), many.get(k)) for k in one.names())
    assert n4 < n1 / (early.SPAN - 1), (n1, n4)
    with open(out / "bank-w2-00000.bin", "r+b") as f:       # block 6: inside the second span
        f.seek(6 * 4096 + 100)
        b = f.read(1)
        f.seek(6 * 4096 + 100)
        f.write(bytes([b[0] ^ 0x20]))
    with pytest.raises(PackedFormatError, match=r"bank-w2-00000\.bin: block 6 .*CRC32"):
        load_packed(out, verify=True)
