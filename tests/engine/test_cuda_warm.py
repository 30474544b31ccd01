"""torch's first CUDA calls made beside the imports (``executor/cuda_warm.py``): started after
``preload`` for a CUDA device only, harmless where CUDA fails, and on a GPU done before the
engine captures its graphs."""
from __future__ import annotations

import pytest
import torch
from procs import python_json

PROBE = """
import json, sys, threading
from freetoken_engine.packed import early_cuda
if sys.argv[1] != "none":
    early_cuda.start(sys.argv[1])          # what preload does with device=...
__import__(sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "import" else "freetoken_engine.llm")
# (importing torch, then the runner, which starts the warm-up: LLM's path or a server's)
from freetoken_engine.executor import cuda_warm
started = any(t.name == "ft-torch-warm" for t in threading.enumerate()) or cuda_warm._thread is not None
status = cuda_warm.wait()
out = {"started": started, "status": status}
if sys.argv[2] == "generate":
    from freetoken_engine import LLM, SamplingParams
    llm = LLM(sys.argv[3], device="cpu")
    out["tokens"] = llm.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4, temperature=0)).token_ids
if sys.argv[2] == "capture":
    import torch
    g, x = torch.cuda.CUDAGraph(), torch.ones(8, device="cuda")
    with torch.cuda.graph(g):
        y = x * 3
    g.replay()
    out["captured"] = float(y.sum())
print(json.dumps(out))
"""


def _probe(*args) -> dict:
    return python_json(PROBE, *args)


def test_nothing_starts_without_a_cuda_preload():
    for device in ("none", "cpu"):
        got = _probe(device, "-")
        assert got == {"started": False, "status": {}}


@pytest.mark.parametrize("module", ["freetoken_engine.llm", "freetoken_engine.scheduler.service"])
def test_a_cuda_preload_starts_it_at_the_first_torch_import_of_either_path(module):
    got = _probe("cuda", "import", module)
    assert got["started"] and got["status"]["device"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path: a machine without CUDA")
def test_a_warm_up_that_cannot_reach_cuda_says_why_and_the_engine_runs(tiny_checkpoint):
    got = _probe("cuda", "generate", str(tiny_checkpoint("qwen3_moe")))
    assert got["started"] and got["status"]["device"] == 0
    assert got["status"]["error"] and got["status"]["seconds"] is None
    assert len(got["tokens"]) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_warm_up_completes_and_a_graph_captures_after_it():
    got = _probe("cuda", "capture")
    assert got["started"] and got["status"]["error"] is None and got["status"]["seconds"] > 0
    assert got["captured"] == 24.0
