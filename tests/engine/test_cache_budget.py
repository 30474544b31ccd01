"""The expert cache's default size on a GPU (executor/budget.py) leaves room for what the engine
allocates after the cache: the KV pool, the prefill's two layer buffers, a prefill step's peak
and a reserve for the decode graphs. Pure arithmetic on the free memory the runner reads from
the driver. And a hybrid model's state slots: checkpoints and draft snapshots within budget."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken_engine.cache.kv import KVPool, kv_pool_bytes
from freetoken_engine.errors import ConfigError
from freetoken_engine.executor.budget import RESERVE_BYTES, default_cache_experts, prefill_peak_bytes, state_slots

GiB = 1 << 30
EXPERT = 3 * 2048 * 768 * 2          # one Qwen3-30B-A3B expert, bf16
TOTAL = 48 * 128
KV = kv_pool_bytes(48, 40960, 4, 128, 2)   # its 40,960-token context, 4 KV heads of 128, bf16
BUFFERS = 2 * 128 * EXPERT            # two whole layers
# an 8192-token prefill step at that context: 32 query / 4 KV heads, top-8, H 2048, I 768
STEP = prefill_peak_bytes(8192, 40960, 8, 2048, 768, 32, 4, 128, 2)


def test_the_kv_pool_formula_is_the_pools_own_size():
    pool = KVPool(3, 5, 16, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert kv_pool_bytes(3, 5 * 16, 2, 8, 2) == pool.nbytes


@pytest.mark.parametrize("card_gib", [16, 24, 32])
def test_a_consumer_card_keeps_room_for_the_kv_pool_and_the_layer_buffers(card_gib):
    free = card_gib * GiB - int(2.46e9) - (600 << 20)      # less the dense weights and the CUDA context
    n = default_cache_experts(free, EXPERT, TOTAL, KV, BUFFERS, STEP)
    after = KV + BUFFERS + STEP + RESERVE_BYTES
    assert n * EXPERT + after <= free < (n + 1) * EXPERT + after      # all that is left, in whole experts
    assert int(0.85 * free / EXPERT) * EXPERT + KV + BUFFERS > free    # the old 85% left no room


def test_a_small_model_is_cached_whole():
    assert default_cache_experts(80 * GiB, EXPERT, 64, KV, 2 * 8 * EXPERT, STEP) == 64


def test_a_card_too_small_for_the_kv_pool_says_what_to_lower():
    with pytest.raises(ConfigError, match=r"the GPU has 6\.0 GB free: the KV cache \(8\.1 GB\).*--max-context"):
        default_cache_experts(6 * 10**9, EXPERT, TOTAL, 2 * KV, BUFFERS, STEP)


def test_a_prefill_steps_peak_is_reserved_as_measured_on_the_h200():
    """The reserve for a prefill step bounds the peaks measured on the H200 by at most 15% more
    where flash attention reads the grouped KV heads in place (bf16, the GPU default: device run
    126) and 25% more where they are repeated to every query head (runs 121, 126): tokens, keys
    -> measured GB (bench/results/engine_gpu_prefill*.json)."""
    for tokens, keys, measured in [(8192, 16384, 0.53), (8192, 32768, 0.53)]:
        reserved = prefill_peak_bytes(tokens, keys, 8, 2048, 768, 32, 4, 128, 2) / 1e9
        assert measured <= reserved <= 1.15 * measured, (tokens, keys, reserved)
    for tokens, keys, measured in [(8192, 8192, 0.57), (8192, 16384, 0.70), (8192, 32768, 0.97),
                                   (16384, 16384, 1.13), (2048, 8192, 0.24)]:
        reserved = prefill_peak_bytes(tokens, keys, 8, 2048, 768, 32, 4, 128, 2, grouped=False) / 1e9
        assert measured <= reserved <= 1.25 * measured, (tokens, keys, reserved)
    # at a 40k context an 8k step reserves 0.62 GB (1.37 GB with repeated heads)
    assert 0.55e9 < STEP < 0.7e9


def test_a_prefill_step_that_leaves_no_expert_says_to_lower_the_step():
    with pytest.raises(ConfigError, match=r"a prefill step \(0\.6 GB\).*--prefill-chunk"):
        default_cache_experts(KV + BUFFERS + STEP + RESERVE_BYTES + EXPERT // 2, EXPERT, TOTAL, KV, BUFFERS, STEP)


def _cfg(**kw):
    return SimpleNamespace(**{"state_checkpoints": None, "speculative_tokens": 0, "max_batch": 8, **kw})


@pytest.mark.parametrize("device,slot_mb,want", [
    ("cpu", 50, (20, 0)),        # 1 GB on the CPU holds 20 checkpoints of 50 MB
    ("cuda", 50, (10, 0)),       # 0.5 GB on a GPU
    ("cpu", 500, (4, 0)),        # never fewer than 4
    ("cpu", 1, (64, 0)),         # never more than 64
])
def test_a_hybrid_models_checkpoints_fill_their_budget_within_bounds(device, slot_mb, want):
    assert state_slots(_cfg(), int(slot_mb * 1e6), torch.device(device)) == want


def test_draft_snapshots_are_k_per_sequence_the_budget_holds_and_a_set_count_is_kept():
    cpu = torch.device("cpu")
    assert state_slots(_cfg(speculative_tokens=4), int(50e6), cpu) == (20, 4 * 5)     # 5 rows of 4 in 1 GB
    assert state_slots(_cfg(speculative_tokens=4), int(1e6), cpu) == (64, 4 * 8)      # at most max_batch rows
    assert state_slots(_cfg(speculative_tokens=4), int(400e6), cpu) == (4, 4)        # at least one row
    assert state_slots(_cfg(state_checkpoints=7), int(50e6), cpu) == (7, 0)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_a_four_bit_bank_leaves_room_for_the_prefills_dense_scratch(monkeypatch, mxfp4):
    """Experts kept in 4 bits on a GPU: a whole-layer call decodes them into a dense scratch
    (kernels/triton/moe_mx_dense.py), so the default cache leaves that scratch free too, exactly
    its bytes (gpt-oss-120b's expert shape, 40 GB free)."""
    from freetoken_engine.executor.budget import cache_experts
    from freetoken_engine.kernels.mxfp4 import row_bytes
    from freetoken_engine.kernels.triton import moe_mx_dense
    h = inter = 2880
    per = 3 * h * row_bytes(h) if mxfp4 else 3 * h * inter * 2
    bank = SimpleNamespace(total_experts=36 * 128, expert_bytes=per, hidden=h, inter=inter, mxfp4=mxfp4,
                           num_experts=128, w13=[SimpleNamespace(nbytes=128 * per * 2 // 3)],
                           w2=[SimpleNamespace(nbytes=128 * per // 3)])
    cfg = SimpleNamespace(expert_cache_experts=None, expert_cache_gb=None, prefill_tokens=4096, kv_block_size=16,
                          max_batch=8)
    mcfg = SimpleNamespace(kv_layers=36, num_kv_heads=8, num_heads=8, head_dim=64, mla=None, linear_layers=[],
                           sliding_window=(), moe=SimpleNamespace(top_k=4))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 10**9, 80 * 10**9))
    n = cache_experts(cfg, mcfg, bank, torch.device("cuda"), torch.bfloat16, 8192, 512)
    bank.mxfp4 = False
    plain = cache_experts(cfg, mcfg, bank, torch.device("cuda"), torch.bfloat16, 8192, 512)
    scratch = moe_mx_dense.scratch_bytes(h, inter, 2, 128)
    assert scratch == moe_mx_dense.scratch_experts(h, inter, 2) * 3 * h * inter * 2 >= 3 * h * inter * 2
    if mxfp4:       # the scratch's bytes, in whole experts of the cache (either side of the rounding)
        assert scratch // per <= plain - n <= -(-scratch // per)
    else:
        assert n == plain
