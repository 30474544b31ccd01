"""The split by stage (``kernels/triton/stage.py``): n CPU experts of a layer have their W2 copied to
the device while the host computes their activations; the device runs their down projection. It
must mark as many experts as the documented balance asks (in 1-token calls) and keep the cache's
choices; the handshake that adds the device's down projection to the host's zero rows is tested
with the streamed split's (``test_stream_split.py``)."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import pytest  # noqa: E402
import torch  # noqa: E402

from branch_steps import random_bank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.kernels import cpu_experts, reference
from freetoken_engine.kernels.triton.stage import stage_down_forward

LAYERS, EXPERTS, H, I, K, T, GRANULE = 3, 12, 64, 32, 4, 3, 8
compiled = pytest.mark.skipif(not cpu_experts.available(), reason="needs the compiled CPU kernel")


def _bank(dtype=torch.float32):
    return random_bank(LAYERS, EXPERTS, H, I, dtype, seed=11, scale=0.1)


def _expected_n(m: int, q: int, share: float, max_streamed: int) -> int:
    """n = 3 (c share - q (1 - share)) rounded, in [0, min(c, NS)]."""
    c = m - q
    want = int(torch.floor(torch.tensor(3.0 * (c * share - q * (1 - share)) + 0.5)))
    return min(max(want, 0), min(c, max_streamed))


@pytest.mark.parametrize("floor_fills", [False, True])
@pytest.mark.parametrize("share,max_streamed", [(0.34, 8), (0.5, 2), (0.2, 8)])
def test_stage_split_marks_the_balanced_count_and_keeps_the_cache_choices(share, max_streamed, floor_fills):
    """Against the same control without the split (rounded q* fills, or floor fills for both): the
    same fills, victims and CPU experts every call; 1-token calls stage the balanced count of CPU
    experts (so none where PCIe already has the longer share), 2-token calls none."""
    bank = _bank()
    plain = DeviceControl.from_cache(ExpertCache(bank, 14, "cpu", fill_fraction=share))
    if floor_fills:
        plain.set_stream(max_streamed, GRANULE, floor_fills=True)
    stage = DeviceControl.from_cache(ExpertCache(bank, 14, "cpu", fill_fraction=share))
    stage.set_stream(max_streamed, GRANULE, floor_fills=floor_fills, stage=True)
    g = torch.Generator().manual_seed(2)
    marked = skipped = 0
    for step in range(8):
        for layer in range(LAYERS):
            tokens = 1 + step % 2
            ids = torch.stack([torch.randperm(7, generator=g)[:K] for _ in range(tokens)])
            a, b = plain.step(layer, ids), stage.step(layer, ids)
            for name in ("pair_slot", "fill_exp", "fill_slot", "cpu_exp", "step_counts"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name      # the same cache choices
            _, m, q, _ = b.step_counts.tolist()
            n = int(b.stream_rows)
            assert n == (_expected_n(m, q, share, max_streamed) if tokens == 1 else 0)
            skipped += tokens > 1 and _expected_n(m, q, share, max_streamed) > 0
            first = set(b.cpu_exp[:n].tolist())
            want = [j if s < 0 and int(e) in first else -1 for e, s in zip(ids.reshape(-1), b.pair_slot)
                    for j in [b.cpu_exp.tolist().index(int(e)) if int(e) in first else -1]]
            assert b.pair_stream.tolist() == want
            marked += n
    assert marked > 0 and skipped > 0


def test_down_projection_kernel_matches_torch_and_zeroes_other_pairs():
    g = torch.Generator().manual_seed(0)
    w2 = torch.randn(3, 40, 24, generator=g)
    act = torch.randn(5, 24, generator=g)
    stream = torch.tensor([2, -1, 0, 2, -1])
    out = stage_down_forward(act, w2, stream)
    for p, s in enumerate(stream.tolist()):
        want = w2[s] @ act[p] if s >= 0 else torch.zeros(40)
        torch.testing.assert_close(out[p], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="act \\[>= P, I\\] and w2 \\[S, H, I\\] expected"):
        stage_down_forward(act[:3], w2, stream)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_activations_match_the_reference(dtype):
    bank = _bank(dtype)
    x = torch.randn(2, H).to(dtype)
    tok, exp = torch.tensor([0, 1, 0]), torch.tensor([3, 3, 7])
    got = cpu_experts.experts_act(x, bank.w13[1], bank.w2[1], tok, exp)
    want = reference.expert_pairs_act(x, bank.w13[1], tok, exp)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(IndexError, match="expert 99"):
        cpu_experts.experts_act(x, bank.w13[1], bank.w2[1], tok, torch.tensor([3, 99, 7]))
