"""How many experts the GPU's expert cache gets by default: what is free, less what the engine
allocates after the cache.

The cache is made before the KV pool and the prefill's two whole-layer buffers
(``cache/prefetch.py``), so sizing it from the free memory alone (as before 2026-12-01: 85% of
it) left a 24 GB card without room for them: Qwen3-30B-A3B at its 40,960-token context needs
4.0 GB of KV pool and 2.4 GB of layer buffers after the cache. The default takes those, exactly,
off the free memory first, then what a prefill step holds at its peak (``prefill_peak_bytes``)
and a fixed reserve for the decode graphs and the allocator's slack.
"""
from __future__ import annotations

from ..errors import ConfigError

#: the decode graphs captured at start and while idle (about 0.45 GB at 48 layers and a 40k
#: context: 12-14 MB a graph, device run 118) and the allocator's slack (not measured)
RESERVE_BYTES = int(0.75 * (1 << 30))
GB = 1e9


#: the whole-layer MoE's peak against its pairs' rows alone (pair indices, routing weights, the
#: allocator's rounding): 1.13x on the H200 (device run 126, an 8k step with 16k and 32k keys)
MOE_OVERHEAD = 1.15


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
