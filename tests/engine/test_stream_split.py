"""The streamed split (``kernels/triton/stream.py``): a CPU expert's first intermediate rows are
also copied to the device and computed there while the CPU computes the rest. It must not change
what the cache holds or fills, its rows must balance PCIe against the CPU as documented, and the
two partial sums must add up to the whole expert (exactly in float32 up to summation order)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from branch_steps import HostThread, random_bank
from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels import cpu_experts, reference
from freetoken_engine.kernels.cpu_branch import CpuBranch
from freetoken_engine.kernels.triton import handshake
from freetoken_engine.kernels.triton.control_outputs import StreamSplit

LAYERS, EXPERTS, H, I, K, T, GRANULE = 3, 12, 64, 32, 4, 3, 8


def _bank(dtype=torch.float32) -> ExpertBank:
    return random_bank(LAYERS, EXPERTS, H, I, dtype, seed=11, scale=0.1)


def _expected_rows(m: int, q: int, share: float, max_streamed: int) -> int:
    """The documented rule: rows / I = (c share - q (1 - share)) / min(c, NS), rounded to the
    granule, in [0, I - granule]; 0 without CPU experts."""
    c = m - q
    if c == 0:
        return 0
    r = (c * share - q * (1 - share)) / min(c, max_streamed)
    return min(max(int(r * I / GRANULE + 0.5) * GRANULE, 0), I - GRANULE)


@pytest.mark.parametrize("share,max_streamed", [(0.4, 8), (0.3, 1), (0.25, 2)])
def test_streamed_split_keeps_the_cache_policy_and_balances_the_rows(share, max_streamed):
    bank = _bank()
    plain = DeviceControl.from_cache(ExpertCache(bank, 14, "cpu", fill_fraction=share))
    split = DeviceControl.from_cache(ExpertCache(bank, 14, "cpu", fill_fraction=share))
    split.set_stream(max_streamed, GRANULE)
    g = torch.Generator().manual_seed(2)
    streamed = 0
    for step in range(6):
        for layer in range(LAYERS):
            ids = torch.stack([torch.randperm(7, generator=g)[:K] for _ in range(1 + step % 2)])
            a, b = plain.step(layer, ids), split.step(layer, ids)
            for name in ("pair_slot", "fill_exp", "fill_slot", "cpu_exp", "step_counts"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            _, m, q, c = b.step_counts.tolist()
            rows = int(b.stream_rows)
            assert rows == _expected_rows(m, q, share, max_streamed)
            # a streamed pair: a CPU pair whose expert is among the first NS CPU experts
            cpu_rank = {int(e): j for j, e in enumerate(b.cpu_exp.tolist()) if e >= 0}
            want = [cpu_rank.get(int(e), -1) if s < 0 and rows > 0 and cpu_rank.get(int(e), -1) < max_streamed
                    else -1 for e, s in zip(ids.reshape(-1), b.pair_slot)]
            assert b.pair_stream.tolist() == want
            streamed += rows > 0
    assert streamed > 0
    assert torch.equal(plain.slot_of, split.slot_of) and plain.counters() == split.counters()


def test_floor_rule_fills_no_more_than_f_m():
    """With floor_fills no layer call is PCIe-bound: q = floor(f m) (the slot cap aside), and the
    streamed rows then balance the rest."""
    bank = _bank()
    ctl = DeviceControl.from_cache(ExpertCache(bank, 5, "cpu", fill_fraction=0.4, admit_window=0))  # the rule alone
    ctl.set_stream(8, GRANULE, floor_fills=True)
    g = torch.Generator().manual_seed(6)
    seen = set()
    for step in range(6):
        for layer in range(LAYERS):
            ids = torch.stack([torch.randperm(9, generator=g)[:K] for _ in range(1 + step % T)])
            hits, m, q, c = ctl.step(layer, ids).step_counts.tolist()
            assert q == min(int(0.4 * m + 1e-9), 5 - hits)
            seen.add(m)
    assert len(seen) > 2
    ctl.set_stream(None)                       # back to the rounded rule
    assert ctl.fill_table[2].item() == 1 and ctl.stream is None


@pytest.mark.skipif(not cpu_experts.available(), reason="needs the compiled CPU kernel")
@pytest.mark.parametrize("stage", [False, True], ids=["rows", "stage"])
@pytest.mark.parametrize("dtype,max_streamed", [(torch.float32, 8), (torch.float32, 1), (torch.bfloat16, 2)])
def test_device_and_host_halves_add_up_to_the_expert(dtype, max_streamed, stage):
    """The whole handshake with the split on: GPU pairs from the slots, streamed pairs as the
    device part plus the host part, the other CPU pairs from the host; max_streamed 1 gives
    layers with both kinds of CPU pair (two host calls, rows put back in pair order). With the
    split by stage (``stage.py``) the device part is the down projection of the host's
    activations (after the act flag) and the host part a zero row."""
    bank = _bank(dtype)
    cache = ExpertCache(bank, 10, "cpu", fill_fraction=0.34 if stage else 0.25)
    ctl = DeviceControl.from_cache(cache)
    ctl.set_stream(max_streamed, GRANULE, stage=stage)
    br = CpuBranch(bank.w13, bank.w2, T, K, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for step in range(4):
        t = 1 + step % T
        tok = torch.arange(t).repeat_interleave(K)
        counts = torch.zeros(LAYERS, 4, dtype=torch.int64)
        host = HostThread(br, tokens=t)
        handshake.bump(br.epoch)
        for l in range(LAYERS):
            x = torch.randn(t, H, generator=g).to(dtype)
            ids = torch.stack([torch.randperm(9, generator=g)[:K] for _ in range(t)])
            out = ctl.step(l, ids, copy=False, mirror=(br.pair_slot[l, :t * K], counts[l], br.pair_exp[l, :t * K],
                                                      br.from_rows[l:l + 1]))
            handshake.signal(br.flag[l:l + 1], br.epoch, src=x, dst=br.x[l, :t])
            ctl.copy(l, out)
            dev = out.pair_slot >= 0
            got = torch.zeros(t * K, H, dtype=dtype)
            got[dev] = cpu_experts.experts_forward(x, cache.w13, cache.w2, tok[dev], out.pair_slot[dev])
            part = ctl.streamed_forward(x, tok, out)
            if stage:
                assert part is None
                handshake.wait(br.act_flag[l:l + 1], br.epoch, br.err)
                part = ctl.stage_forward(br.act, out)
            assert part[out.pair_stream < 0].abs().max() == 0     # zero rows for every other pair
            handshake.wait(br.done[l:l + 1], br.epoch, br.err)
            host_rows = br.rows[:int((~dev).sum())]
            if stage:
                assert not host_rows[out.pair_stream[~dev] >= 0].any()      # split pairs: zero host rows
            got[~dev] = host_rows + part[~dev]
            want = reference.expert_pairs_forward(x, bank.w13[l], bank.w2[l], tok, ids.reshape(-1))
            torch.testing.assert_close(got.float(), want.float(), **tol)
        host.join()
    br.check()
    assert br.totals["stage_pairs" if stage else "streamed_rows"] > 0 and br.totals["steps"] == 4


@pytest.mark.skipif(not cpu_experts.available(), reason="needs the compiled CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_computes_the_rest_of_each_expert(dtype):
    bank = _bank(dtype)
    x = torch.randn(2, H).to(dtype)
    tok, exp = torch.tensor([0, 0, 1]), torch.tensor([3, 7, 3])
    w13, w2 = bank.w13[1], bank.w2[1]
    for start in (8, 24):
        got = cpu_experts.experts_forward(x, w13, w2, tok, exp, rows_from=start)
        rest = reference.expert_pairs_forward(x, torch.cat((w13[:, start:I], w13[:, I + start:]), 1),
                                              w2[:, :, start:], tok, exp)
        torch.testing.assert_close(got.float(), rest.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_bad_splits_are_refused_with_a_clear_error():
    bank = _bank()
    ctl = DeviceControl.from_cache(ExpertCache(bank, 5, "cpu", fill_fraction=0.4))
    with pytest.raises(ValueError, match="granule"):
        ctl.set_stream(4, granule=12)              # I = 32 is not a multiple of 12
    with pytest.raises(ValueError, match="granule"):
        StreamSplit(0.4, I, 32, 4).check()   # fewer than two granules
    with pytest.raises(ValueError, match="rows_from"):
        cpu_experts.experts_forward(torch.zeros(1, H), bank.w13[0], bank.w2[0], torch.tensor([0]),
                                    torch.tensor([0]), rows_from=I)
    ctl.set_stream(None)
    assert ctl.stream is None and ctl.streamed_forward(torch.zeros(1, H), torch.tensor([0]), ctl.outputs(1)) is None


@pytest.mark.skipif(not cpu_experts.available(), reason="needs the compiled CPU kernel")
@pytest.mark.parametrize("stream", [False, True])
def test_engine_branch_signals_the_host_before_copying_and_adds_the_parts(stream, monkeypatch):
    """The engine's decode layer (``HostBranch.layer``): the host is signalled before the fills
    (and streamed rows) are copied, so the CPU experts overlap PCIe; the rows equal the experts'."""
    from freetoken_engine.cache import host_branch as hb

    bank = _bank()
    cache = ExpertCache(bank, 10, "cpu", fill_fraction=0.25)
    ctl = DeviceControl.from_cache(cache)
    if stream:
        ctl.set_stream(2, GRANULE)
    branch = hb.HostBranch(bank, K, T, torch.device("cpu"), torch.float32)
    order = []
    signal, copy = hb.handshake.signal, ctl.copy
    monkeypatch.setattr(hb.handshake, "signal", lambda *a, **kw: (order.append("signal"), signal(*a, **kw)))
    monkeypatch.setattr(ctl, "copy", lambda *a: (order.append("copy"), copy(*a)))
    g = torch.Generator().manual_seed(9)
    try:
        for step in range(3):
            t = 1 + step % 2
            tok = torch.arange(t).repeat_interleave(K)
            for l in range(LAYERS):
                x = torch.randn(t, H, generator=g)
                ids = torch.stack([torch.randperm(9, generator=g)[:K] for _ in range(t)])
                got = branch.layer(ctl, l, x, ids, tok)[0].dense()
                want = reference.expert_pairs_forward(x, bank.w13[l], bank.w2[l], tok, ids.reshape(-1))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            branch.finish()
    finally:
        branch.close()
    assert order == ["signal", "copy"] * (3 * LAYERS)
    assert (branch.br.totals["streamed_rows"] > 0) == stream
