"""The calibration's fill gather (calibrate._GatherFills) copies exactly the rows it times, a
different expert each launch, under TRITON_INTERPRET=1 on small rows. Its timing needs CUDA
events: tests/gpu/test_calibrate_gpu.py."""
from __future__ import annotations

import interpret  # noqa: E402  (first: it turns the Triton interpreter on)

interpret.require()

import torch  # noqa: E402

from freetoken_engine import calibrate  # noqa: E402


def test_each_fill_copies_the_next_expert_of_sixteen_exactly(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)    # no page-locking on a CPU
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(calibrate, "HIDDEN", 64)
    monkeypatch.setattr(calibrate, "INTER", 32)
    fills = calibrate._GatherFills(torch.device("cpu"))
    assert fills.path == "gather" and fills.per == 3 * 64 * 32 * 2
    for t in (fills.src13, fills.src2):
        t.view(torch.int16).random_()
    seen = []
    for _ in range(17):            # the 16 experts in turn, then the first again
        fills._copy()
        e = fills.turn % 16
        seen.append(e)
        assert torch.equal(fills.dst13[0].view(torch.int16), fills.src13[0, e].view(torch.int16))
        assert torch.equal(fills.dst2[0].view(torch.int16), fills.src2[0, e].view(torch.int16))
    assert sorted(set(seen)) == list(range(16))
