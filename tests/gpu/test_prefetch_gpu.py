"""Cross-layer expert prefetch (``FREETOKEN_EXPERT_PREFETCH``) inside captured CUDA decode
graphs on a real GPU: its copies run on a stream of their own, and the result is the graphs'
without it."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM  # noqa: E402
from freetoken_engine.cache.device_control import DeviceControl  # noqa: E402

from graph_cases import PROMPTS, lockstep  # noqa: E402


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("options,mode", [
    ({"expert_cache_experts": 6, "cpu_expert_fraction": 0.0}, "device"),    # fills only
    ({"expert_cache_experts": 5, "cpu_expert_fraction": 0.5}, "branch"),    # + CPU pairs
])
@pytest.mark.parametrize("overlap", [True, False])
def test_prefetching_the_next_layers_guesses_in_graphs_keeps_the_tokens(tiny_checkpoint, model, options, mode,
                                                                        overlap, monkeypatch):
    """FREETOKEN_EXPERT_PREFETCH=all inside captured decode graphs: each layer's guess of the next
    layer's experts is copied on a stream of its own while the layer computes, and the next
    layer's experts wait for those copies. Against the same graphs without prefetch: the same
    tokens and float32 logits within 1e-4 (a guess moves an expert between the CPU and the GPU:
    the short prompts' prefill has CPU pairs even where decode fills every miss). Every replayed
    step made prefetch steps, and the cache's books still balance. (A prefetch that stamped
    with the guessed step's clock made a hit a victim here: other tokens.)"""
    monkeypatch.setattr(DeviceControl, "overlap_hits", overlap)
    folder = tiny_checkpoint(model)
    runs = []
    for prefetch in ("off", "all"):            # (all: "on" prefetches for one sequence only)
        monkeypatch.setenv("FREETOKEN_EXPERT_PREFETCH", prefetch)
        llm = LLM(folder, device="cuda", dtype="float32", **options)
        tokens, logits = lockstep(llm, PROMPTS, 16)
        graphs = llm.runner.graphs
        assert graphs.replays >= 12
        assert {g.mode for (b, _), g in graphs._graphs.items() if b == len(PROMPTS)} == {mode}
        runs.append((tokens, logits, llm))
    (want, want_logits, _), (got, logits, llm) = runs
    assert got == want
    assert (logits - want_logits).abs().max() < 1e-4
    pf = llm.runner.experts.control.prefetch_counters()
    assert pf["hits"] + pf["misses"] > 0 and pf["fills"] > 0
    s = llm.runner.expert_stats()
    assert s["fills"] + s["cpu_computed"] == s["misses"]
    llm.runner.experts.sync_stats()
    llm.runner.cache.check_integrity(deep=True)
