"""The compiled CPU expert kernel against the PyTorch reference (kernels/reference.py).

Tolerance (the contract in cpu_experts' docstring): fp32 x: |y - ref| <= 1e-4 max|ref| + 1e-5;
bf16 x: |y - ref| <= 2e-2 max|ref|. Every instruction set this CPU supports is checked (the AMX
tiles only where the CPU and the OS allow them; those tests skip elsewhere, saying why).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from freetoken_engine.kernels import cpu_experts as ce
from freetoken_engine.kernels.reference import expert_pairs_forward

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler here")


def _isas() -> list[str]:
    if not ce.available():
        return []
    best = ce.cpu_features()["best_isa"]
    return list(ce.ISAS[: ce.ISAS.index(best) + 1])


@pytest.fixture
def kernel_config():
    """Restore the kernel's settings after a test changes them."""
    if not ce.available():
        pytest.skip("compiled kernel unavailable")
    before = ce.configure()
    yield
    ce.configure(threads=before.threads, isa=before.isa, prefetch_bytes=before.prefetch_bytes)


def _problem(T, H, I, E, P, xd, wd, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(xd)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(wd)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(wd)
    tok = torch.randint(0, T, (P,), generator=g)
    exp = torch.randint(0, E, (P,), generator=g)
    return x, w13, w2, tok, exp


def _close(y, ref):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = ref.float().abs().max().item()
    err = (y.float() - ref.float()).abs().max().item()
    tol = 1e-4 * scale + 1e-5 if ref.dtype == torch.float32 else 2e-2 * scale
    assert err <= tol, f"max error {err:.3g} > tolerance {tol:.3g} (max |ref| {scale:.3g})"


@needs_compiler
def test_compiled_kernel_is_built_and_named():
    assert ce.available()
    assert ce.backend_name() in {f"cpu-{i}" for i in ce.ISAS}


SHAPES = [  # T, H, I, E, P: decode sizes, odd sizes (vector tails), one pair, many pairs
    (1, 64, 32, 4, 1),
    (3, 100, 37, 6, 17),
    (8, 257, 129, 16, 64),
    (5, 512, 96, 128, 40),
    (16, 256, 96, 3, 48),     # 4-16+ tokens per expert, H and I multiples of 32 (the AMX tiles)
]


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("wd", [torch.float32, torch.bfloat16], ids=["w32", "wbf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d_H%d_I%d_E%d_P%d" % s)
def test_matches_reference_on_every_isa(kernel_config, shape, xd, wd):
    x, w13, w2, tok, exp = _problem(*shape, xd, wd)
    ref = expert_pairs_forward(x, w13, w2, tok, exp)
    for isa in _isas():
        ce.configure(isa=isa)
        _close(ce.experts_forward(x, w13, w2, tok, exp), ref)


@pytest.mark.parametrize("xd", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
def test_few_pairs_on_a_large_bank(kernel_config, xd):
    """A few pairs on a bank of many experts (a decode step's CPU experts over a whole bank) are
    grouped by sorting the pairs instead of counting over the experts: the same groups in the
    same order, so the rows are bitwise those of the same pairs on a slice of the bank that the
    counting sort groups, and match the reference."""
    x, w13, w2, _, _ = _problem(6, 128, 64, 256, 1, xd, torch.bfloat16)
    tok = torch.tensor([5, 0, 3, 1, 0, 2, 4, 5, 1, 3, 2])
    exp = torch.tensor([9, 2, 9, 30, 2, 9, 17, 2, 30, 30, 9])        # repeats, out of order
    big = ce.experts_forward(x, w13, w2, tok, exp)                  # 11 * 8 < 256: sorted pairs
    small = ce.experts_forward(x, w13[:32].contiguous(), w2[:32].contiguous(), tok, exp)   # counted
    assert torch.equal(big, small)
    _close(big, expert_pairs_forward(x, w13, w2, tok, exp))


needs_amx = pytest.mark.skipif(not ce.available() or ce.cpu_features()["best_isa"] != "amx",
                               reason="no AMX-BF16 here (or the OS does not grant the tile state)")


@needs_amx
def test_amx_tiles_match_reference_and_ignore_thread_count(kernel_config):
    """Groups of 1-40 tokens on one expert each (below the tile threshold, one 16-token tile
    block, several blocks and a tail): the tile path against the reference, bitwise the same at
    1 and 2 threads, and an AMX group's rows do not depend on the other experts' pairs."""
    counts = [1, 3, 4, 7, 16, 17, 40]
    x, w13, w2, _, _ = _problem(40, 256, 96, len(counts), 1, torch.bfloat16, torch.bfloat16)
    tok = torch.cat([torch.randperm(40, generator=torch.Generator().manual_seed(e))[:c] for e, c in enumerate(counts)])
    exp = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ref = expert_pairs_forward(x, w13, w2, tok, exp)
    ce.configure(isa="amx", threads=1)
    one = ce.experts_forward(x, w13, w2, tok, exp)
    _close(one, ref)
    ce.configure(threads=2)
    assert torch.equal(ce.experts_forward(x, w13, w2, tok, exp), one)
    alone = exp == 4                                   # the 16-token group by itself
    assert torch.equal(ce.experts_forward(x, w13, w2, tok[alone], exp[alone]), one[alone])


@needs_amx
def test_amx_groups_sharing_token_lists(kernel_config):
    """Groups with equal token lists share one packed copy of their tokens (amx_pack.h): equal
    lists next to each other and apart, beyond the look-back (10 distinct lists in between), and
    near misses that must not share (the same tokens in another order, a longer list with the
    same start). Every group's rows match the reference and are bitwise those of the group
    computed alone, at 1 and 4 threads."""
    gen = torch.Generator().manual_seed(5)
    a = [0, 2, 3, 5, 7, 8]
    lists = ([a, a, a[::-1], a + [9], a]                         # experts 0-4
             + [torch.randperm(24, generator=gen)[:5 + e % 4].tolist() for e in range(10)]   # 5-14
             + [a, a])                                            # 15-16: beyond the look-back
    x, w13, w2, _, _ = _problem(24, 256, 96, len(lists), 1, torch.bfloat16, torch.bfloat16)
    tok = torch.tensor([t for lst in lists for t in lst])
    exp = torch.cat([torch.full((len(lst),), e) for e, lst in enumerate(lists)])
    ref = expert_pairs_forward(x, w13, w2, tok, exp)
    for threads in (1, 4):
        ce.configure(isa="amx", threads=threads)
        y = ce.experts_forward(x, w13, w2, tok, exp)
        _close(y, ref)
        for e in range(len(lists)):
            alone = exp == e
            assert torch.equal(ce.experts_forward(x, w13, w2, tok[alone], exp[alone]), y[alone]), f"expert {e}"


def test_isa_the_cpu_lacks_is_refused(kernel_config):
    """Forcing an instruction set this CPU (or its OS) does not allow raises instead of crashing."""
    missing = [isa for isa in ce.ISAS if isa not in _isas()]
    if not missing:
        pytest.skip("this CPU has every instruction set the kernel knows")
    with pytest.raises(ValueError, match="not supported"):
        ce.configure(isa=missing[-1])
    assert ce.backend_name() != f"cpu-{missing[-1]}"


def test_out_is_written_in_place(kernel_config):
    """out= (e.g. a pinned buffer) receives the rows and is returned; a wrong one is refused."""
    x, w13, w2, tok, exp = _problem(4, 128, 64, 6, 32, torch.bfloat16, torch.bfloat16)
    out = torch.full((32, 128), float("nan"), dtype=torch.bfloat16)
    y = ce.experts_forward(x, w13, w2, tok, exp, out=out)
    assert y is out
    _close(out, expert_pairs_forward(x, w13, w2, tok, exp))
    with pytest.raises(ValueError, match="out must be"):
        ce.experts_forward(x, w13, w2, tok, exp, out=torch.empty(32, 128))   # fp32 for bf16 x


@needs_compiler
def test_workers_wake_from_sleep(tmp_path):
    """After the pool's workers went to sleep (idle longer than spin_us), the next calls wake
    them and give the same rows as one thread (a lost wake-up would hang: run in a child)."""
    code = textwrap.dedent("""
        import time, torch
        from freetoken_engine.kernels import cpu_experts as ce
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
        w13 = (torch.randn(5, 192, 256, generator=g) / 16).to(torch.bfloat16)
        w2 = (torch.randn(5, 256, 96, generator=g) / 10).to(torch.bfloat16)
        tok, exp = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 1, 4, 0])
        ce.configure(threads=1)
        want = ce.experts_forward(x, w13, w2, tok, exp)
        ce.configure(threads=3, spin_us=0)
        for _ in range(20):
            time.sleep(0.005)
            assert torch.equal(ce.experts_forward(x, w13, w2, tok, exp), want)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr


def test_empty_pairs_give_empty_output():
    x, w13, w2, _, _ = _problem(2, 64, 32, 4, 1, torch.float32, torch.bfloat16)
    empty = torch.zeros(0, dtype=torch.int64)
    y = ce.experts_forward(x, w13, w2, empty, empty)
    assert y.shape == (0, 64) and y.dtype == torch.float32


def test_strided_expert_views_are_read_in_place(kernel_config):
    """A bank layer slice and a strided slot view: expert strides pass through, no copy."""
    bank13 = (torch.randn(3, 10, 64, 96) / 10).to(torch.bfloat16)   # [L, E, 2I, H]
    bank2 = (torch.randn(3, 10, 96, 32) / 10).to(torch.bfloat16)    # [L, E, H, I]
    w13, w2 = bank13[1, ::2], bank2[1, ::2]                         # every other expert
    x = torch.randn(4, 96)
    tok, exp = torch.tensor([0, 1, 2, 3, 0]), torch.tensor([4, 0, 2, 2, 1])
    _close(ce.experts_forward(x, w13, w2, tok, exp), expert_pairs_forward(x, w13, w2, tok, exp))


def test_result_independent_of_threads_and_pair_order(kernel_config):
    """A pair's output is bitwise the same whatever the thread count or the other pairs."""
    x, w13, w2, tok, exp = _problem(6, 256, 64, 12, 30, torch.float32, torch.bfloat16)
    ce.configure(threads=1)
    one = ce.experts_forward(x, w13, w2, tok, exp)
    ce.configure(threads=2)
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(1))
    two = ce.experts_forward(x, w13, w2, tok[perm], exp[perm])
    assert torch.equal(two, one[perm])


@pytest.mark.skipif("avx512bf16" not in _isas(), reason="no AVX512-BF16 here: bf16 x goes through fp32")
def test_bf16_groups_ignore_pair_order_and_threads(kernel_config):
    """bf16 x on the vector path (the bf16 dot): a group of 12 tokens on one expert (token blocks
    of 8 and 4) and groups of 3 and 1: within tolerance of the reference, and each pair's output
    bitwise the same whatever the pair order, the thread count and the other groups."""
    x, w13, w2, _, _ = _problem(16, 256, 96, 3, 1, torch.bfloat16, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    tok = torch.cat([torch.randperm(16, generator=g)[:12], torch.randperm(16, generator=g)[:3], torch.tensor([5])])
    exp = torch.cat([torch.full((12,), 0), torch.full((3,), 1), torch.tensor([2])])
    ce.configure(isa="avx512bf16", threads=1)
    one = ce.experts_forward(x, w13, w2, tok, exp)
    _close(one, expert_pairs_forward(x, w13, w2, tok, exp))
    ce.configure(threads=2)
    for seed in range(3):
        perm = torch.randperm(len(tok), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ce.experts_forward(x, w13, w2, tok[perm], exp[perm]), one[perm])
    small = exp > 0                                     # the groups of 3 and 1 by themselves
    assert torch.equal(ce.experts_forward(x, w13, w2, tok[small], exp[small]), one[small])


@pytest.fixture
def knobs():
    """Restore the kernel's tuning knobs after a test changes them."""
    if not ce.available():
        pytest.skip("compiled kernel unavailable")
    before = ce.tune()
    yield before
    ce.tune(**before)


def test_tuning_knobs_change_no_bit_of_the_result(kernel_config, knobs):
    """Chunk sizes and prefetch settings (bench/cpu_kernel_tune.py sweeps them) only move work
    between threads and lines between caches: every pair's output stays bitwise the same, on
    the vector path and (where the CPU has them) the tiles; and the call's phases are in order."""
    x, w13, w2, tok, exp = _problem(12, 256, 96, 6, 48, torch.bfloat16, torch.bfloat16)
    exp[:16] = 2                                        # a 16-token group: the tiles on an AMX CPU
    ce.configure(threads=2)
    want = ce.experts_forward(x, w13, w2, tok, exp)
    _close(want, expert_pairs_forward(x, w13, w2, tok, exp))
    phases = ce.last_timing()
    assert 0 <= phases["posted"] <= phases["last_start"] <= phases["end"]
    assert phases["posted"] <= phases["stage1_end"] <= phases["end"]
    for setting in ({"chunks_per_thread": 1}, {"chunks_per_thread": 64}, {"far_pf": 0}, {"far_pf": 16},
                    {"far_pf_tokens": 1}, {"small_far_pf": 0}, {"small_far_pf": 16},
                    {"amx_next": 0, "amx_pf": 512}, {"amx_pf": 4096}):
        ce.tune(**{**knobs, **setting})
        got = ce.experts_forward(x, w13, w2, tok, exp, out=torch.full_like(want, float("nan")))  # no row left out
        assert torch.equal(got, want), setting
    ce.tune(**knobs)
    ce.tune(amx_min_tokens=1 << 20)                     # tiles off: the vector path, same tolerance
    _close(ce.experts_forward(x, w13, w2, tok, exp), expert_pairs_forward(x, w13, w2, tok, exp))
    # float32 tokens on bf16 rows (a CPU engine's default): one- and two-token groups take the L2
    # prefetch too (small_far_pf), and it moves no bit either
    ce.tune(**knobs)
    xf, w13f, w2f, tokf, expf = _problem(3, 256, 96, 6, 6, torch.float32, torch.bfloat16)
    want = ce.experts_forward(xf, w13f, w2f, tokf, expf)
    for setting in ({"small_far_pf": 0}, {"small_far_pf": 16}):
        ce.tune(**{**knobs, **setting})
        assert torch.equal(ce.experts_forward(xf, w13f, w2f, tokf, expf), want), setting


def test_calls_timed_from_c_run_the_same_calls(kernel_config):
    """calls_seconds (calibration's B_cpu) times a batch of calls, and an expert out of range in
    any row is refused before it is read, with the row's pair named."""
    x, w13, w2, _, _ = _problem(1, 256, 64, 8, 1, torch.bfloat16, torch.bfloat16)
    tok, exps = torch.zeros(2, dtype=torch.int64), torch.tensor([[0, 1], [2, 3], [4, 5]])
    assert 0 < ce.calls_seconds(x, w13, w2, tok, exps) < 10
    with pytest.raises(IndexError, match="expert 8 out of range"):
        ce.calls_seconds(x, w13, w2, tok, torch.tensor([[0, 1], [8, 2]]))
    with pytest.raises(ValueError, match="pair_exps must be"):
        ce.calls_seconds(x, w13, w2, tok, torch.tensor([0, 1]))
    # partial rows (the streamed split's CPU share, bench/cpu_partial_rows.py), range-checked
    assert 0 < ce.calls_seconds(x, w13, w2, tok, exps, rows_from=32) < 10
    with pytest.raises(ValueError, match=r"rows_from must be in \[0, 64\), got 64"):
        ce.calls_seconds(x, w13, w2, tok, exps, rows_from=64)


def test_unknown_or_out_of_range_knobs_are_refused(knobs):
    with pytest.raises(ValueError, match="unknown tuning knob 'chunk'"):
        ce.tune(chunk=4)
    with pytest.raises(ValueError, match="amx_next"):
        ce.tune(amx_next=2)
    with pytest.raises(ValueError, match="non-negative int"):
        ce.tune(far_pf=-1)
    assert ce.tune() == knobs


def test_bad_inputs_raise_clear_errors():
    x, w13, w2, tok, exp = _problem(2, 64, 32, 4, 3, torch.float32, torch.float32)
    with pytest.raises(IndexError):
        ce.experts_forward(x, w13, w2, tok, torch.tensor([0, 9, 1]))
    with pytest.raises(ValueError):
        ce.experts_forward(x, w13[:, :, :32], w2, tok, exp)
    with pytest.raises(ValueError):
        ce.configure(threads=0)


def test_every_call_the_hot_path_declines_gets_the_general_paths_result_or_error(kernel_config):
    """experts_forward's decode fast path (one read of each attribute) takes the usual call only:
    int32 pairs, a transposed x, fp16 x, x needing grad, a strided w2 column, a bad ``out`` or
    ``rows_from``, and mismatched pairs still get the reference's rows or a clear error."""
    x, w13, w2, tok, exp = _problem(4, 64, 32, 6, 10, torch.bfloat16, torch.bfloat16)
    want = expert_pairs_forward(x, w13, w2, tok, exp)
    _close(ce.experts_forward(x, w13, w2, tok, exp), want)
    _close(ce.experts_forward(x, w13, w2, tok.int(), exp.int()), want)
    _close(ce.experts_forward(x.t().contiguous().t(), w13, w2, tok, exp), want)
    xh = x.half()
    _close(ce.experts_forward(xh, w13, w2, tok, exp), expert_pairs_forward(xh, w13, w2, tok, exp))
    xg = x.float().requires_grad_()
    y = ce.experts_forward(xg, w13.float(), w2.float(), tok, exp)
    assert y.requires_grad                                           # the reference, differentiable
    wide = torch.cat((w2, w2), 2)[:, :, ::2]                         # stride 2 along I
    _close(ce.experts_forward(x, w13, wide, tok, exp), expert_pairs_forward(x, w13, wide, tok, exp))
    for bad in (torch.empty(10, 64), torch.empty(9, 64, dtype=torch.bfloat16),
                torch.empty(64, 10, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out must be"):
            ce.experts_forward(x, w13, w2, tok, exp, out=bad)
    with pytest.raises(ValueError, match=r"rows_from must be in \[0, 32\), got 32"):
        ce.experts_forward(x, w13, w2, tok, exp, rows_from=32)
    with pytest.raises(ValueError, match="must be equal 1-D"):
        ce.experts_forward(x, w13, w2, tok, exp[:9])
    with pytest.raises(IndexError, match="out of range"):
        ce.experts_forward(x, w13, w2, tok, torch.full_like(exp, 6))


def test_default_threads_use_every_cpu_without_a_gpu_and_leave_one_with_it(monkeypatch):
    """Without a GPU the engine's thread only waits for the experts: every CPU computes; with a
    GPU one CPU stays with the engine; the environment variable overrides both."""
    monkeypatch.delenv(ce.ENV_THREADS, raising=False)
    monkeypatch.setattr(ce.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(ce, "gpu_present", lambda: False)
    assert ce.default_threads() == 4
    monkeypatch.setattr(ce, "gpu_present", lambda: True)
    assert ce.default_threads() == 3
    monkeypatch.setattr(ce.os, "sched_getaffinity", lambda pid: {5})
    assert ce.default_threads() == 1
    monkeypatch.setenv(ce.ENV_THREADS, "2")
    assert ce.default_threads() == 2


def test_falls_back_to_reference_with_one_warning_without_compiler(tmp_path):
    """No compiler and no cached build: one warning line, reference results, nothing breaks."""
    code = textwrap.dedent("""
        import torch
        from freetoken_engine.kernels import cpu_experts as ce
        from freetoken_engine.kernels.reference import expert_pairs_forward
        x = torch.randn(3, 64); w13 = torch.randn(4, 64, 64); w2 = torch.randn(4, 64, 32)
        tok = torch.tensor([0, 1, 2]); exp = torch.tensor([3, 3, 0])
        for _ in range(3):
            y = ce.experts_forward(x, w13, w2, tok, exp)
        assert torch.equal(y, expert_pairs_forward(x, w13, w2, tok, exp))
        print(ce.available(), ce.backend_name())
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), FREETOKEN_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "reference"]
    warnings = [ln for ln in r.stderr.splitlines() if "CPU expert kernel unavailable" in ln]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]


@needs_compiler
def test_engine_registry_uses_the_compiled_kernel(monkeypatch):
    """The engine's CPU expert path (kernels.cpu_expert_forward) picks this kernel when it builds."""
    monkeypatch.delenv("FREETOKEN_CPU_EXPERT_BACKEND", raising=False)
    from freetoken_engine.kernels import cpu_expert_forward
    name, fn = cpu_expert_forward()
    assert name == "compiled" and fn is ce.experts_forward
