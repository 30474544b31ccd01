"""Prompts and a lockstep greedy decode shared by the GPU tests of captured decode graphs
(tests/gpu/test_graphs_gpu.py, test_prefetch_gpu.py)."""
from __future__ import annotations

import torch

from freetoken_engine import LLM
from freetoken_engine.llm import Lockstep

PROMPTS = [list(range(3, 253)), [5, 17, 99, 200, 3, 44, 12, 300], [7]]     # 250 tokens: crosses 256


def lockstep(llm: LLM, prompts: list[list[int]], steps: int, resize_at: int | None = None):
    """Greedy-decode ``prompts`` together; -> (tokens per prompt, logits [steps, B, V])."""
    batch, rows = Lockstep(llm, prompts), []
    for step in range(steps):
        if step == resize_at:
            llm.runner.resize_expert_cache(max(2, llm.runner.cache.capacity // 2))
        rows.append(batch.step().cpu())
    batch.close()
    return batch.tokens, torch.stack(rows)
