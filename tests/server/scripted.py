"""TEMPORARY stand-in for the lead's EngineService (docs/contracts.md), used only until
freetoken_engine.scheduler.service lands. Deterministic fake generation over the real tokenizer."""
from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass

from freetoken_engine.errors import QueueFull, RequestTooLong


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    finish_reason: str | None


def install_fake_module():
    try:
        import freetoken_engine.scheduler.service  # noqa: F401
    except ImportError:
        mod = types.ModuleType("freetoken_engine.scheduler.service")
        mod.SamplingParams = SamplingParams
        sys.modules["freetoken_engine.scheduler.service"] = mod


class Handle:
    def __init__(self, svc, ids, params, out):
        self.svc, self.params, self.out = svc, params, out
        self.prompt_tokens = len(ids)
        self.cached_tokens = svc._cached(ids)
        self.aborted = False
        self.i = 0

    def abort(self):
        self.aborted = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.aborted or self.i >= len(self.out) or self.i >= self.params.max_new_tokens:
            self.svc.running -= 0
            raise StopAsyncIteration
        await asyncio.sleep(self.svc.delay)
        tok = self.out[self.i]
        self.i += 1
        reason = None
        if tok in self.params.stop_token_ids:
            reason = "stop"
        elif self.i >= self.params.max_new_tokens:
            reason = "length"
        if reason:
            self.aborted = True
        return TokenEvent(tok, reason)


class ScriptedService:
    def __init__(self, tokenizer, script=None, max_context=512, delay=0.001, queue_limit=1000):
        self.tokenizer, self.script, self.max_context = tokenizer, script, max_context
        self.delay, self.queue_limit, self.model_name = delay, queue_limit, "tiny"
        self.seen: list[list[int]] = []
        self.live = 0
        self.capacity = 8
        self.running = 0
        self.health_state = {"status": "ok", "progress": 1.0, "error": None}

    def health(self):
        return dict(self.health_state)

    def _cached(self, ids):
        best = 0
        for s in self.seen:
            n = 0
            for a, b in zip(s, ids):
                if a != b:
                    break
                n += 1
            best = max(best, n // 16 * 16)
        self.seen.append(list(ids))
        return best

    def submit(self, ids, params):
        if len(ids) + params.max_new_tokens > self.max_context:
            raise RequestTooLong("too long")
        if self.queue_limit <= 0:
            raise QueueFull("queue full", retry_after=2.5)
        if self.script is not None:
            text = self.script(self.tokenizer.decode(ids, skip_special_tokens=False))
            out = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_ids[0]]
        else:
            v = self.tokenizer.vocab_size
            out = [(sum(ids) * 31 + 17 * i * i) % (v - 20) + 10 for i in range(params.max_new_tokens)]
        return Handle(self, ids, params, out)

    def cache_stats(self):
        return {"expert_cache": {"capacity_experts": self.capacity, "capacity_bytes": self.capacity * 3,
                                 "expert_bytes": 3, "min_experts": 1, "max_experts": 16, "hits": 1,
                                 "misses": 2, "fills": 2, "cpu_computed": 0, "fill_fraction": 1.0},
                "kv": {"blocks_total": 10, "blocks_used": 2, "block_size": 16},
                "device": "cpu", "device_bytes": 0}

    async def resize_expert_cache(self, experts=None, bytes=None):
        self.capacity = max(1, experts if experts is not None else bytes // 3)
        return self.cache_stats()

    def calibrate(self, measure=False, pcie_gbps=None, cpu_expert_gbps=None, fill_fraction=None):
        return {"pcie_gbps": None, "cpu_expert_gbps": 20.0, "concurrent": {}, "fill_fraction": 1.0,
                "device": "cpu", "host": "x", "measured_at": "now"}

    def stats(self):
        return {"running": 0, "queued": 0, "kv_blocks_total": 10, "kv_blocks_used": 2,
                "prefix_hit_ratio": 0.5, "cpu_expert_gbps": 20.0}

    def shutdown(self):
        pass
