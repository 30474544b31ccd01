"""Decode steps between a long prefill pass's layers on a GPU (scheduler/beside.py): the engine a
user runs (scheduler, expert cache smaller than the model, CPU branch, decode graphs) gives the
requests decoding beside a long prompt their tokens during its pass, and every request's tokens
equal its tokens alone (float32)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from beside_cases import LAYERS, LONG, SHORT, always_due, count_tokens_inside_long_passes, greedy, run_all  # noqa: E402

from freetoken_engine import LLM  # noqa: E402
from freetoken_engine.config import EngineConfig  # noqa: E402
from freetoken_engine.scheduler.service import EngineService  # noqa: E402

OPTIONS = dict(device="cuda", dtype="float32", expert_cache_experts=12, cpu_expert_fraction=0.5)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_moe_text"])      # the second: Gated DeltaNet
@pytest.mark.parametrize("graphs", [True, False])
async def test_gpu_decoders_get_their_tokens_inside_a_long_pass_and_every_output_is_as_alone(tiny_checkpoint, graphs,
                                                                                            model_type):
    folder = tiny_checkpoint(model_type, num_hidden_layers=LAYERS)
    llm = LLM(folder, cuda_graphs=graphs, **OPTIONS)
    alone = [llm.generate(p, greedy(24)).token_ids for p in SHORT], llm.generate(LONG, greedy(4)).token_ids
    del llm
    svc = EngineService.start(EngineConfig(model=folder, max_batch=4, prefill_chunk=100, cuda_graphs=graphs,
                                           **OPTIONS), wait=True)
    try:
        always_due(svc)
        inside = count_tokens_inside_long_passes(svc)
        assert await run_all(svc) == alone
        stats = svc.stats()
        svc.scheduler.check_integrity()
    finally:
        svc.shutdown()
    assert inside[1:] == [(3 * (LAYERS - 1), 1)] * 3, inside
    assert stats["decode_steps_beside"] == 3 * (LAYERS - 1)
    assert stats["expert_cache"]["cpu_computed"] > 0             # the split ran beside the passes
    assert (stats["decode_graph_replays"] > 0) == graphs
