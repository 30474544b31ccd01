"""``EngineConfig``: the run options of ``freetoken generate`` / ``serve`` and the Python API,
validated once at the edge (``ConfigError`` with a message that says what to fix); re-exported
by ``config``, beside the model's own ``ModelConfig``."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


SPECULATIVE_METHODS = ("ngram", "mtp")


def check_device(device: str, present: bool = True) -> str:
    """``device`` if the engine can run there: "cpu", "cuda" or "cuda:N"; with ``present``, the
    GPU must also be on this host (torch is imported only then). Else a ``ConfigError`` that says
    what to give instead."""
    if device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if present and device != "cpu":
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ConfigError(f"--device {device} was given but no CUDA GPU is available")
        if device != "cuda" and int(device[5:]) >= n:
            raise ConfigError(f"--device {device}: this host has {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}")
    return device


@dataclass(frozen=True)
class EngineConfig:
    """Run options shared by ``generate``, ``serve`` and the Python API."""

    model: Path
    device: str = "cpu"
    dtype: str | None = None                 # None: bfloat16 on cuda, float32 on cpu
    expert_cache_experts: int | None = None  # slots in the shared expert cache
    expert_cache_gb: float | None = None
    cpu_expert_fraction: float | None = None  # forced share of misses computed in place
    expert_backend: str = "auto"             # torch | triton | auto (triton on CUDA)
    expert_format: str = "auto"              # auto | mxfp4 | dense: a checkpoint's MXFP4 experts kept in 4 bits
    cuda_graphs: bool = True                 # capture decode steps as CUDA graphs (CUDA + triton)
    graph_warmup: int = 4                    # capture batch sizes 1..N at start (0: on first use)
    graph_warmup_widths: int = 1             # ... at the narrowest N KV widths (0: all); the rest when idle
    graph_memory_gb: float = 0.5             # the decode graphs' device memory, at most about (0: no limit)
    split_tuning: bool = False               # refine q* online by measured decode step time (CUDA)
    cpu_rate_probe: bool = True              # q* by the CPU's rate on this model and under contention
    fused_cpu_decode: bool = True            # CPU decode steps of plain MoE layers in two compiled calls
    prefill_chunk: int | None = None         # None: 512 on the CPU, 8192 on a GPU (prefill_tokens)
    prefill_expert_threshold: int | None = None  # whole-layer MoE from this many tokens (None: max_batch + 1)
    decode_pause_ms: float | None = None     # decoders' steps inside a long pass after this wait (decode_pause)
    kv_block_size: int = 16
    state_checkpoints: int | None = None     # hybrid models: recurrent-state checkpoints at anchors (None: by memory)
    kv_cache_tokens: int | None = None       # None: enough for max_batch full contexts, capped
    kv_window_store: bool = True             # sliding-window layers keep only their windows' keys (cache/kv.py)
    max_context: int | None = None
    max_batch: int = 32
    max_queue: int = 256
    speculative_tokens: int = 0              # n-gram (prompt-lookup) draft tokens per decode step (0: off)
    speculative_ngram: tuple[int, int] = (2, 4)   # shortest and longest suffix a draft is matched on
    speculative_max_batch: int = 1           # drafts only in steps with at most this many decoding requests
    speculative_method: str = "ngram"        # ngram (prompt lookup) | mtp (the checkpoint's own MTP layer)
    speculative_draft_vocab: int = 0         # mtp: drafts among the first N token ids only (0: every id)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_device(self.device, present=False)
        for name in ("expert_cache_gb", "cpu_expert_fraction", "graph_memory_gb", "decode_pause_ms"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):    # inf passed the range checks
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.expert_cache_experts is not None and self.expert_cache_gb is not None:
            raise ConfigError("give --expert-cache-experts or --expert-cache-gb, not both")
        if self.expert_cache_experts is not None and self.expert_cache_experts < 1:
            raise ConfigError(f"--expert-cache-experts must be at least 1, got {self.expert_cache_experts}")
        if self.expert_cache_gb is not None and not self.expert_cache_gb > 0:
            raise ConfigError(f"--expert-cache-gb must be positive, got {self.expert_cache_gb}")
        f = self.cpu_expert_fraction
        if f is not None and not 0.0 <= f <= 1.0:
            raise ConfigError(f"--cpu-expert-fraction must be within 0..1, got {f}")
        if self.expert_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"--expert-backend must be auto, torch or triton, got {self.expert_backend!r}")
        if self.expert_format not in ("auto", "mxfp4", "dense"):
            raise ConfigError(f"--expert-format must be auto, mxfp4 or dense, got {self.expert_format!r}")
        if self.graph_warmup < 0:
            raise ConfigError(f"--graph-warmup must be 0 or more, got {self.graph_warmup}")
        if not self.graph_memory_gb >= 0:
            raise ConfigError(f"--graph-memory-gb must be 0 (no limit) or more, got {self.graph_memory_gb}")
        if self.graph_warmup_widths < 0:
            raise ConfigError(f"--graph-warmup-widths must be 0 (every width) or more, got {self.graph_warmup_widths}")
        if self.prefill_expert_threshold is not None and self.prefill_expert_threshold < 2:
            raise ConfigError(f"prefill_expert_threshold must be at least 2, got {self.prefill_expert_threshold}")
        if self.decode_pause_ms is not None and not self.decode_pause_ms >= 0:
            raise ConfigError(f"--decode-pause-ms must be 0 (decode tokens ride in the prefill's pass) or more, "
                              f"got {self.decode_pause_ms}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.max_context is not None and self.max_context < 1:
            raise ConfigError(f"--max-context must be at least 1 token, got {self.max_context} "
                              "(leave it out for the model's own context)")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ConfigError(f"--state-checkpoints must be 0 (none) or more, got {self.state_checkpoints}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ConfigError(f"--speculative-tokens must be within 0 (off)..16, got {self.speculative_tokens}")
        lo, hi = self.speculative_ngram
        if not 1 <= lo <= hi <= 16:
            raise ConfigError(f"--speculative-ngram must be MIN,MAX with 1 <= MIN <= MAX <= 16, got {lo},{hi}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-method must be {' or '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.speculative_method!r}")
        if self.speculative_method == "mtp" and not self.speculative_tokens:
            raise ConfigError("--speculative-method mtp drafts nothing without --speculative-tokens K (1..16)")
        if self.speculative_draft_vocab < 0:
            raise ConfigError(f"--speculative-draft-vocab must be 0 (every token id) or more, "
                              f"got {self.speculative_draft_vocab}")
        if self.speculative_max_batch < 1:
            raise ConfigError(f"--speculative-max-batch must be at least 1, got {self.speculative_max_batch}")
        for name in ("kv_block_size", "max_batch", "max_queue"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1")

    @property
    def expert_threshold(self) -> int:
        """Tokens in a batch from which a MoE layer streams whole layers (prefill) instead of
        going through the expert cache: by default above every decode batch (max_batch), so a
        server's decode steps keep the cache, the q* split and the decode graphs."""
        return self.prefill_expert_threshold or self.max_batch + 1

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens per prefill step: ``prefill_chunk``, by default 512 on the CPU and 8192 on a
        GPU. A GPU step streams every expert its cache lacks whatever the step's size, so the
        step, not the token, is the cost: on an H200 an 8k-token prompt took 0.52 s in one step
        and 8.1 s in 512-token steps with a 32 GB card's cache (bench/engine_gpu_prefill.py,
        device run 121), and the 8k step's peak above the weights was 0.6 GB."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return 512 if self.device == "cpu" else 8192

    @property
    def decode_pause(self) -> float:
        """Milliseconds the requests decoding beside a long prefill pass wait before a decode step
        of their own inside it (scheduler/beside.py; 0: they ride in the pass): ``decode_pause_ms``,
        by default 100 on a GPU, where those steps overlap the pass's PCIe stream (the prompt's
        TTFT did not move on the H200), and 500 on the CPU, where they compete with it for the
        same cores (at 100 ms: 1.25-1.29x a 2k prompt's TTFT and 0.92x many short chats'
        throughput on the 2-CPU VM; docs/gpu.md)."""
        if self.decode_pause_ms is not None:
            return self.decode_pause_ms
        return 500.0 if self.device == "cpu" else 100.0

    @property
    def resolved_dtype(self) -> str:
        if self.dtype:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
