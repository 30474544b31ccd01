"""How much the engine's caches get: the expert cache's slots (by default on a GPU: what is free,
less what the engine allocates after the cache) and a hybrid model's recurrent-state slots.

The cache is made before the KV pool and the prefill's two whole-layer buffers
(``cache/prefetch.py``), so sizing it from the free memory alone (as before 2026-12-01: 85% of
it) left a 24 GB card without room for them: Qwen3-30B-A3B at its 40,960-token context needs
4.0 GB of KV pool and 2.4 GB of layer buffers after the cache. The default takes those, exactly,
off the free memory first, then what a prefill step holds at its peak (``prefill_peak_bytes``)
and a fixed reserve for the decode graphs and the allocator's slack (and, for experts kept in 4
bits, the dense scratch in which a whole-layer call decodes them).
"""
from __future__ import annotations

import math

import torch

from ..cache.kv import model_kv_bytes
from ..cache.states import StatePool
from ..errors import ConfigError
from ..layers.attention import reads_grouped_heads

#: the decode graphs captured at start and while idle (about 0.45 GB at 48 layers and a 40k
#: context: 12-14 MB a graph, device run 118) and the allocator's slack (not measured)
RESERVE_BYTES = int(0.75 * (1 << 30))
GB = 1e9
#: the recurrent-state checkpoints' and draft snapshots' default budget, by device type
STATE_BUDGET = {"cpu": 1e9, "cuda": 5e8}


#: the whole-layer MoE's peak against its pairs' rows alone (pair indices, routing weights, the
#: allocator's rounding): 1.13x on the H200 (device run 126, an 8k step with 16k and 32k keys)
MOE_OVERHEAD = 1.15


def default_kv_blocks(cfg, max_context: int) -> int:
    """The KV pool's blocks: ``--kv-cache-tokens``, by default two contexts up to 32k tokens,
    at least one context."""
    return -(-max(cfg.kv_cache_tokens or min(2 * max_context, 32768), max_context) // cfg.kv_block_size)


def prefill_peak_bytes(tokens: int, context: int, top_k: int, hidden: int, inter: int, heads: int,
                       kv_heads: int, head_dim: int, itemsize: int, grouped: bool = True) -> int:
    """What a prefill step of ``tokens`` tokens holds at its peak, above the weights, the cache and
    the KV pool: the whole-layer MoE's rows of every (token, expert) pair, in and out of the
    gate/up and down projections (``tokens x top_k x (hidden + 2 inter)``, times MOE_OVERHEAD),
    and one chunk's attention at ``context`` keys: its keys and values gathered from the paged
    pool (``2 x context x kv_heads x head_dim``), and repeated to every query head where flash
    attention does not read them ``grouped`` (float32 data: ``+ 2 x context x heads x head_dim``).
    Against the H200's measured peaks (Qwen3-30B-A3B's shapes, bf16, an 8k step): grouped, 0.57 /
    0.61 GB for 16k / 32k keys against 0.53 / 0.53 measured (run 126); repeated, 1.18-1.22x (runs
    121 and 126: 0.57 / 0.70 / 0.97 GB for 8k / 16k / 32k keys)."""
    moe = MOE_OVERHEAD * tokens * top_k * (hidden + 2 * inter)
    keys = 2 * context * (kv_heads if grouped else heads + kv_heads) * head_dim
    return int((moe + keys) * itemsize)


def default_cache_experts(free: int, expert_bytes: int, total_experts: int, kv_bytes: int,
                          layer_buffers: int, prefill_bytes: int) -> int:
    """Experts the cache holds on a GPU with ``free`` bytes free now: what is left after the KV
    pool, the prefill's layer buffers (``layer_buffers`` bytes), a prefill step's peak
    (``prefill_bytes``) and ``RESERVE_BYTES``, in whole experts, at most every expert. Raises
    ConfigError, naming what to change, when not one expert is left."""
    left = free - kv_bytes - layer_buffers - prefill_bytes - RESERVE_BYTES
    n = min(total_experts, left // expert_bytes) if left > 0 else 0
    if n < 1:
        raise ConfigError(
            f"the GPU has {free / GB:.1f} GB free: the KV cache ({kv_bytes / GB:.1f} GB), the prefill's "
            f"layer buffers ({layer_buffers / GB:.1f} GB), a prefill step ({prefill_bytes / GB:.1f} GB) and "
            f"{RESERVE_BYTES / GB:.1f} GB for decode graphs leave no room for one expert "
            f"({expert_bytes / GB:.3f} GB); lower --max-context (the KV cache holds that many tokens or "
            f"more) or --prefill-chunk, or set --expert-cache-gb")
    return int(n)


def cache_experts(cfg, mcfg, bank, device: torch.device, dtype: torch.dtype, max_context: int,
                  kv_blocks: int) -> int:
    """The expert cache's slots for engine config ``cfg`` and model config ``mcfg``:
    ``--expert-cache-experts``; else ``--expert-cache-gb`` in whole experts (at most the model);
    else every expert on the CPU; else, on a GPU, what its free memory leaves after the KV pool of
    ``kv_blocks`` blocks, the recurrent states (about their default budget), the prefill's layer
    buffers and a prefill step (``default_cache_experts``). Raises ConfigError, saying what to
    change, for a budget that holds no expert or more experts than the model has."""
    total, per = bank.total_experts, bank.expert_bytes
    if cfg.expert_cache_experts is not None:
        n = cfg.expert_cache_experts
    elif cfg.expert_cache_gb is not None:
        n = math.floor(cfg.expert_cache_gb * 1e9 / per)
        if n < 1:
            raise ConfigError(f"--expert-cache-gb {cfg.expert_cache_gb} holds no expert "
                              f"(one expert is {per / 1e9:.4f} GB)")
        n = min(n, total)               # a budget larger than the model: cache everything
    elif device.type == "cpu":
        n = total
    else:                 # what is left after the KV pool, the layer buffers and a prefill step
        size = dtype.itemsize
        kv = model_kv_bytes(cfg, mcfg, kv_blocks, size)
        if mcfg.linear_layers:   # the recurrent states: about their default budget (state_slots)
            slot = StatePool.slot_bytes(len(mcfg.linear_layers), mcfg.linear, size)
            kv += min(STATE_BUDGET["cuda"], 64 * slot) + cfg.max_batch * slot
        a = mcfg.mla
        if a is not None:    # a prompt chunk expands every head's keys and values (layers/mla.py)
            kv_heads, dim, grouped = mcfg.num_heads, max(a.nope_dim + a.rope_dim, a.v_dim), True
        else:
            kv_heads, dim, grouped = mcfg.num_kv_heads, mcfg.head_dim, reads_grouped_heads(device, dtype, mcfg)
        step = prefill_peak_bytes(cfg.prefill_tokens, max_context, mcfg.moe.top_k, bank.hidden, bank.inter,
                                  mcfg.num_heads, kv_heads, dim, size, grouped)
        if bank.mxfp4:       # a whole-layer call's dense scratch (kernels/triton/moe_mx_dense.py)
            from ..kernels.triton.moe_mx_dense import scratch_bytes
            step += scratch_bytes(bank.hidden, bank.inter, size, bank.num_experts)
        n = default_cache_experts(torch.cuda.mem_get_info(device)[0], per, total, kv,
                                  2 * (bank.w13[0].nbytes + bank.w2[0].nbytes), step)
    if n > total:
        raise ConfigError(f"expert cache of {n} experts is larger than the model's {total} experts")
    return n


def state_slots(cfg, slot_bytes: int, device: torch.device) -> tuple[int, int]:
    """A hybrid model's ``(anchor checkpoints, draft snapshots)`` beside its batch rows' slots of
    ``slot_bytes`` each. Checkpoints: ``--state-checkpoints``, by default as many as the device's
    ``STATE_BUDGET`` holds, from 4 to 64. Snapshots for speculative drafts (``--speculative-tokens``
    k): k per drafting sequence, for as many sequences as that budget holds, at least one and at
    most ``max_batch`` (a sequence that finds none free decodes that step without a draft)."""
    budget = STATE_BUDGET["cpu" if device.type == "cpu" else "cuda"]
    n = cfg.state_checkpoints
    if n is None:
        n = max(4, min(64, int(budget // slot_bytes)))
    k = cfg.speculative_tokens
    scratch = k * max(1, min(cfg.max_batch, int(budget // (k * slot_bytes)))) if k else 0
    return n, scratch
