"""The expert cache's default size on a GPU (executor/budget.py) leaves room for what the engine
allocates after the cache: the KV pool and the prefill's two layer buffers, plus a working
reserve. Pure arithmetic on the free memory the runner reads from the driver."""
from __future__ import annotations

import pytest
import torch

from freetoken_engine.cache.kv import KVPool, kv_pool_bytes
from freetoken_engine.errors import ConfigError
from freetoken_engine.executor.budget import WORKING_BYTES, default_cache_experts

GiB = 1 << 30
EXPERT = 3 * 2048 * 768 * 2          # one Qwen3-30B-A3B expert, bf16
TOTAL = 48 * 128
KV = kv_pool_bytes(48, 40960, 4, 128, 2)   # its 40,960-token context, 4 KV heads of 128, bf16
BUFFERS = 2 * 128 * EXPERT            # two whole layers


def test_the_kv_pool_formula_is_the_pools_own_size():
    pool = KVPool(3, 5, 16, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert kv_pool_bytes(3, 5 * 16, 2, 8, 2) == pool.nbytes


@pytest.mark.parametrize("card_gib", [16, 24, 32])
def test_a_consumer_card_keeps_room_for_the_kv_pool_and_the_layer_buffers(card_gib):
    free = card_gib * GiB - int(2.46e9) - (600 << 20)      # less the dense weights and the CUDA context
    n = default_cache_experts(free, EXPERT, TOTAL, KV, BUFFERS)
    after = KV + BUFFERS + WORKING_BYTES
    assert n * EXPERT + after <= free < (n + 1) * EXPERT + after      # all that is left, in whole experts
    assert int(0.85 * free / EXPERT) * EXPERT + KV + BUFFERS > free    # the old 85% left no room


def test_a_small_model_is_cached_whole():
    assert default_cache_experts(80 * GiB, EXPERT, 64, KV, 2 * 8 * EXPERT) == 64


def test_a_card_too_small_for_the_kv_pool_says_what_to_lower():
    with pytest.raises(ConfigError, match=r"the GPU has 6\.0 GB free: the KV cache \(8\.1 GB\).*--max-context"):
        default_cache_experts(6 * 10**9, EXPERT, TOTAL, 2 * KV, BUFFERS)
