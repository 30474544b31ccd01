"""Experts kept in MXFP4 (kernels/mxfp4.py, kernels/cpu/mxfp4.h): the row layout against
transformers' own dequantization, the compiled kernel on every instruction set against the
reference on the dequantized weights, and the engine's 4-bit bank on gpt-oss as
published: the same tokens as transformers in float32, a quarter of the bank's bytes, and the
refusals that say what to do instead."""
from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import ConfigError
from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels import mxfp4, reference
from freetoken_engine.kernels.reference import GatedAct, expert_pairs_forward
from freetoken_engine.run_config import EngineConfig
from test_cpu_kernel import _close, _isas, kernel_config  # noqa: F401  (a fixture)
from test_gpt_oss import _as_mxfp4
from test_parity import PROMPT, check

GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
# T, H, I, E, P: one token, a few tokens on few experts (4+ a group: where AMX would take bf16), many
# pairs, and an odd number of 32-value blocks a row (gpt-oss-20b's 2880 is 90: 1440 is 45, 288 is 9)
SHAPES = [(1, 64, 32, 4, 1), (3, 96, 64, 5, 9), (8, 128, 96, 3, 40), (4, 1440, 288, 6, 16)]


def _problem(T, H, I, E, P, xd, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(xd)
    q13 = mxfp4.quantize(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5)
    q2 = mxfp4.quantize(torch.randn(E, H, I, generator=g) / I ** 0.5)
    return x, q13, q2, torch.randint(0, T, (P,), generator=g), torch.randint(0, E, (P,), generator=g)


def test_rows_repack_the_published_blocks_exactly():
    """The checkpoint's blocks and scales -> rows -> values: transformers' dequantization bit for
    bit, including scales at the ends of the range (2^-127 and 2^127); a row of 17G bytes."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=g)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254
    rows = mxfp4.from_blocks(blocks, scales)
    assert rows.shape == (3, 10, 64 + 16) and rows.dtype == torch.uint8       # codes, 4 scales, 12 zeros
    assert not rows[..., 68:].any()
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(mxfp4.dequantize(rows, torch.float32), want)
    # every row 16-byte aligned: gpt-oss's 2,880 values in 1,440 + 90 + 6 bytes
    assert mxfp4.row_values(rows.shape[-1]) == 128 and mxfp4.row_bytes(2880) == 1536
    assert [mxfp4.row_values(mxfp4.row_bytes(k)) for k in range(32, 8193, 32)] == list(range(32, 8193, 32))
    for bad in (68, 70, 1530):
        with pytest.raises(ValueError, match="no MXFP4 row"):
            mxfp4.row_values(bad)
    with pytest.raises(ConfigError, match="MXFP4 blocks"):
        mxfp4.from_blocks(blocks[..., :8], scales)


def test_quantize_rounds_to_the_nearest_code():
    """The test banks' quantizer: every value within half a code step of its block's grid (the
    largest magnitude exactly representable as 6 times the block's scale or below)."""
    w = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    back = mxfp4.dequantize(mxfp4.quantize(w), torch.float32)
    blocks = w.view(7, 3, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(blocks / 6)))
    assert ((back - w).view(7, 3, 32).abs() <= scale + 1e-7).all()      # the widest step, 4 -> 6, is 2 scales
    assert torch.equal(mxfp4.dequantize(mxfp4.quantize(back), torch.float32), back)   # representable: kept


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d_H%d_I%d_E%d_P%d" % s)
def test_kernel_on_mxfp4_rows_matches_it_on_their_values(kernel_config, monkeypatch, shape, xd):
    """On every instruction set the kernel on 4-bit rows gives the reference's result on their
    dequantized values within test_cpu_kernel's tolerance (the reference itself dequantizes the
    pairs' experts: bit for bit its result on the dense weights)."""
    x, q13, q2, tok, exp = _problem(*shape, xd)
    dense13, dense2 = mxfp4.dequantize(q13, xd), mxfp4.dequantize(q2, xd)
    want = expert_pairs_forward(x, dense13, dense2, tok, exp)
    assert torch.equal(expert_pairs_forward(x, q13, q2, tok, exp), want)         # the reference's own path
    monkeypatch.setattr(reference, "expert_pairs_forward", None)                  # compiled only
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, q13, q2, tok, exp), want)


def test_gpt_oss_experts_on_mxfp4_rows(kernel_config, monkeypatch):
    """gpt-oss's clamped gate and biases (bias rows by expert, weights by slot) on 4-bit rows."""
    x, q13, q2, tok, exp = _problem(3, 96, 64, 5, 9, torch.float32)
    b13 = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    act = GatedAct("swiglu_oai", 1.702, 0.9)
    want = expert_pairs_forward(x, mxfp4.dequantize(q13, x.dtype), mxfp4.dequantize(q2, x.dtype), tok, exp, act, b13)
    monkeypatch.setattr(reference, "expert_pairs_forward", None)
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, q13.flip(0), q2.flip(0), tok, 4 - exp, act=act, b13=b13, pair_bias=exp), want)


def test_bad_mxfp4_calls_raise_clear_errors(kernel_config):
    x, q13, q2, tok, exp = _problem(2, 64, 32, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="MXFP4 rows"):
        ce.experts_forward(x, q13, q2, tok, exp, rows_from=8)
    with pytest.raises(ValueError, match="both or neither"):
        ce.experts_forward(x, q13, mxfp4.dequantize(q2, x.dtype), tok, exp)
    with pytest.raises(ValueError, match="shape mismatch"):
        ce.experts_forward(x[:, :32], q13, q2, tok, exp)
    with pytest.raises(ValueError, match="no MXFP4 row"):
        ce.experts_forward(x, q13, q2[..., :-1], tok, exp)


def test_engine_keeps_published_mxfp4_experts_in_four_bits(tiny_checkpoint, tmp_path):
    """gpt-oss as published on the CPU: the bank holds the experts as MXFP4 rows (17/64 of the
    bf16 bytes at gpt-oss's widths; 16-byte rows of 64 values here: 48 bytes, 3/16 of float32's) and the engine gives transformers' tokens on the dequantized
    weights, with the expert cache and CPU shares too; ``dense`` dequantizes as before, same tokens."""
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, flat = _as_mxfp4(src, tmp_path)
    want = check(mx, n_new=16, ref_folder=flat)
    four, dense = LLM(mx), LLM(mx, expert_format="dense")
    assert four.runner.bank.mxfp4 and four.runner.bank.w13.dtype == torch.uint8
    assert not dense.runner.bank.mxfp4 and dense.runner.bank.w13.dtype == torch.float32
    assert four.runner.bank.expert_bytes * 16 == dense.runner.bank.expert_bytes * 3
    assert four.generate(PROMPT, GREEDY).token_ids == dense.generate(PROMPT, GREEDY).token_ids == want[:12]
    for capacity, fraction in ((1, 0.0), (3, 0.5)):
        got = LLM(mx, expert_cache_experts=capacity, cpu_expert_fraction=fraction).generate(PROMPT, GREEDY)
        assert got.token_ids == want[:12] and got.stats["misses"] > 0


def test_mxfp4_format_refusals_say_what_to_do(tiny_checkpoint):
    """A checkpoint without MXFP4 experts with --expert-format mxfp4, or an unknown format: a
    clear error."""
    with pytest.raises(ConfigError, match="holds no MXFP4 experts"):
        LLM(tiny_checkpoint("gpt_oss"), expert_format="mxfp4")
    with pytest.raises(ConfigError, match="auto, mxfp4 or dense"):
        EngineConfig(model=tiny_checkpoint("gpt_oss"), expert_format="int4")


def test_auto_keeps_four_bits_on_a_gpu_unless_it_holds_every_expert_dense(tiny_checkpoint, monkeypatch):
    """``auto`` on a GPU (its free memory read through torch.cuda.mem_get_info, faked here: this
    machine has none): dense only when the dense bank fits 80% of the free memory; never on the
    CPU. gpt-oss-120b's experts (229 GB dense) stay in 4 bits on a 141 GB card, -20b's (38 GB) are
    dequantized there and stay in 4 bits on a 24 GB one."""
    from dataclasses import replace

    from freetoken_engine.models import build
    cuda = torch.device("cuda")
    ckpt, cfg = build.read_config(tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16))
    ckpt.close()
    dense = cfg.bank_layers * cfg.moe.num_experts * 3 * 64 * 64 * 2
    for free, want in ((dense * 1.25, True), (dense * 1.24, False), (dense * 10, True), (dense // 2, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (int(free), 2 * int(free)))
        assert build.auto_dense(cfg, torch.bfloat16, cuda) is want, free / dense
    assert not build.auto_dense(cfg, torch.bfloat16, torch.device("cpu"))
    for experts_gb, free_gb, want in ((229e9, 141e9, False), (38.2e9, 141e9, True), (38.2e9, 24e9, False)):
        big = replace(cfg, moe=replace(cfg.moe, num_experts=round(experts_gb / (cfg.bank_layers * 3 * 64 * 64 * 2))))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free_gb: (int(free), int(free)))
        assert build.auto_dense(big, torch.bfloat16, cuda) is want, (experts_gb, free_gb)


def test_packed_folder_keeps_mxfp4_experts_in_four_bits(tiny_checkpoint, tmp_path):
    """``freetoken convert`` of a published gpt-oss writes the bank as MXFP4 rows (at 64 values a
    row 48 bytes, 3/16 of the float32 bank's), the engine reads them into a 4-bit bank with the source's tokens (a
    ``dense`` engine dequantizes them as read), ``--expert-format dense`` writes a dense bank, and
    a bank format the engine does not know, or an earlier freetoken's unpadded 4-bit rows, are
    refused with what to do."""
    import json

    from freetoken_engine.packed import convert
    from freetoken_engine.packed.format import INDEX_NAME, PackedFormatError
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, flat = _as_mxfp4(src, tmp_path)
    packed4, packed32 = convert(mx, tmp_path / "p4", progress=False), convert(flat, tmp_path / "p32", progress=False)
    index4, index32 = (json.loads((p / INDEX_NAME).read_text()) for p in (packed4, packed32))
    assert index4["bank"]["format"] == "mxfp4" and index32["bank"]["format"] == "dense"
    bank_bytes = [sum(m["size"] for n, m in i["files"].items() if n.startswith("bank-")) for i in (index4, index32)]
    assert bank_bytes[0] * 16 <= bank_bytes[1] * 3 + 2 * 4096 * 16        # (each piece padded to a page)
    assert index4["bank"]["row_align"] == 16
    want = LLM(mx).generate(PROMPT, GREEDY).token_ids
    llm = LLM(packed4)
    assert llm.runner.bank.mxfp4 and llm.generate(PROMPT, GREEDY).token_ids == want
    dequantized = LLM(packed4, expert_format="dense")     # (what a GPU engine does with it by default)
    assert not dequantized.runner.bank.mxfp4 and dequantized.generate(PROMPT, GREEDY).token_ids == want
    dense = convert(mx, tmp_path / "pd", progress=False, expert_format="dense")        # what a GPU runs fastest
    assert json.loads((dense / INDEX_NAME).read_text())["bank"]["format"] == "dense"
    assert not LLM(dense).runner.bank.mxfp4 and LLM(dense).generate(PROMPT, GREEDY).token_ids == want
    with pytest.raises(PackedFormatError, match="holds no MXFP4 experts"):
        convert(flat, tmp_path / "px", progress=False, expert_format="mxfp4")
    with pytest.raises(ConfigError, match="holds its experts dense"):
        LLM(dense, expert_format="mxfp4")
    index4["bank"]["format"] = "int4"
    (packed4 / INDEX_NAME).write_text(json.dumps(index4))
    with pytest.raises(PackedFormatError, match="bank format 'int4'"):
        LLM(packed4)
    index4["bank"]["format"] = "mxfp4"
    del index4["bank"]["row_align"]
    (packed4 / INDEX_NAME).write_text(json.dumps(index4))
    with pytest.raises(PackedFormatError, match="not padded to 16 bytes .* run `freetoken convert`"):
        LLM(packed4)


def test_cli_convert_takes_the_expert_format(tiny_checkpoint, tmp_path):
    """``freetoken convert --expert-format dense`` writes a dense bank; ``mxfp4`` on a checkpoint
    without MXFP4 experts is one line on stderr and a non-zero exit."""
    import json

    from freetoken_engine.packed.format import INDEX_NAME
    from test_cli import one_line_error, run
    src = tiny_checkpoint("gpt_oss", hidden_size=64, intermediate_size=64, head_dim=16)
    mx, flat = _as_mxfp4(src, tmp_path)
    r = run("convert", "--model", str(mx), "--out", str(tmp_path / "d"), "--expert-format", "dense")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "d" / INDEX_NAME).read_text())["bank"]["format"] == "dense"
    r = run("convert", "--model", str(flat), "--out", str(tmp_path / "x"), "--expert-format", "mxfp4")
    assert r.returncode != 0 and "holds no MXFP4 experts" in one_line_error(r)
