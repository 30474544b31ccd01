"""How many experts the GPU's expert cache gets by default: what is free, less what the engine
allocates after the cache.

The cache is made before the KV pool and the prefill's two whole-layer buffers
(``cache/prefetch.py``), so sizing it from the free memory alone (as before 2026-12-01: 85% of
it) left a 24 GB card without room for them: Qwen3-30B-A3B at its 40,960-token context needs
4.0 GB of KV pool and 2.4 GB of layer buffers after the cache. The default now takes those,
exactly, and a fixed working reserve (activations, the decode graphs' executable images at
12-14 MB a graph for 48 layers, the allocator's slack) off the free memory first.
"""
from __future__ import annotations

from ..errors import ConfigError

#: activations, decode graphs and the allocator's slack (as bench/gpu_offload.py's card budgets)
WORKING_BYTES = int(1.5 * (1 << 30))
GB = 1e9


def default_cache_experts(free: int, expert_bytes: int, total_experts: int, kv_bytes: int,
                          layer_buffers: int) -> int:
    """Experts the cache holds on a GPU with ``free`` bytes free now: what is left after the KV
    pool, the prefill's layer buffers (``layer_buffers`` bytes) and ``WORKING_BYTES``, in whole
    experts, at most every expert. Raises ConfigError, naming what to change, when not one
    expert is left."""
    left = free - kv_bytes - layer_buffers - WORKING_BYTES
    n = min(total_experts, left // expert_bytes) if left > 0 else 0
    if n < 1:
        raise ConfigError(
            f"the GPU has {free / GB:.1f} GB free: the KV cache ({kv_bytes / GB:.1f} GB), the prefill's "
            f"layer buffers ({layer_buffers / GB:.1f} GB) and {WORKING_BYTES / GB:.1f} GB of working memory "
            f"leave no room for one expert ({expert_bytes / GB:.3f} GB); lower --max-context (the KV "
            f"cache holds that many tokens or more) or set --expert-cache-gb")
    return int(n)
