"""``EngineService``: the in-process engine the HTTP layer holds (see docs/contracts.md).

It loads the model in a background thread (``health()`` reports progress), then runs the
scheduler thread. Every public method is thread-safe; ``submit`` is called from the server's
event loop and returns a handle streaming ``TokenEvent``s.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from ..config import EngineConfig
from ..errors import ConfigError, EngineError, InvalidRequest, RequestTooLong
from ..executor.runner import ModelRunner
from ..executor.sampler import SamplingParams, check_guided, make_generator, make_penalties
from .request import Request, RequestHandle
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineService:
    def __init__(self, cfg: EngineConfig, model_name: str | None = None):
        self.cfg = cfg
        self.model_name = model_name or cfg.model.name
        self._status, self._progress, self._error = "loading", 0.0, None
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self.tokenizer = None
        self.max_context = 0
        self.vocab_size = 0                # the logits' width (may exceed the tokenizer's vocabulary)
        self.started_at = time.time()
        self._calibration: dict = {}
        self._ready = threading.Event()

    @classmethod
    def start(cls, cfg: EngineConfig, model_name: str | None = None, wait: bool = False) -> "EngineService":
        svc = cls(cfg, model_name)
        threading.Thread(target=svc._load, name="freetoken-load", daemon=True).start()
        if wait:
            svc.wait_ready()
        return svc

    def _load(self) -> None:
        try:
            runner = ModelRunner(self.cfg, progress=lambda f: setattr(self, "_progress", round(f, 3)))
            self.runner, self.tokenizer, self.max_context = runner, runner.tokenizer, runner.max_context
            self.vocab_size = runner.mcfg.vocab_size
            self.scheduler = Scheduler(runner, self.cfg.max_batch, self.cfg.max_queue, self.cfg.prefill_tokens,
                                       self.cfg.decode_pause, self.cfg.speculative_tokens,
                                       self.cfg.speculative_ngram, self.cfg.speculative_max_batch,
                                       self.cfg.speculative_method)
            self.scheduler.thread.start()
            cache = runner.cache
            self._calibration = {"pcie_gbps": None, "cpu_expert_gbps": None,
                                 "fill_fraction": cache.fill_fraction if cache else 1.0}
            self._status, self._progress = "ok", 1.0
        except Exception as exc:  # reported through /health; the process stays up to say why
            log.exception("model load failed")
            self._status, self._error = "error", str(exc)
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        self._ready.wait(timeout)
        if self._status == "error":
            raise ConfigError(self._error)

    def health(self) -> dict:
        return {"status": self._status, "progress": self._progress, "error": self._error,
                "model": self.model_name}

    def _require_ready(self) -> None:
        if self._status != "ok":
            raise EngineError(f"the model is {self._status}" + (f": {self._error}" if self._error else ""))

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a generation; raises ``InvalidRequest``, ``RequestTooLong`` or ``QueueFull``."""
        self._require_ready()
        vocab = self.runner.mcfg.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        bad = next((t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise RequestTooLong(
                f"this model's context is {self.max_context} tokens; the prompt has {len(prompt_ids)} "
                f"and {params.max_new_tokens} new tokens were requested: shorten the prompt or lower max_tokens")
        check_guided(params, self.tokenizer, vocab)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        handle = RequestHandle(loop)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self.runner.eos_token_ids)
        req = Request(prompt_ids=list(prompt_ids), params=params,
                      generator=make_generator(params, self.cfg.seed), stop_ids=frozenset(stop),
                      max_new_tokens=params.max_new_tokens, sink=handle,
                      penalties=make_penalties(params, prompt_ids, vocab))
        handle.request = req

        def abort() -> None:
            if not req.finished:
                req.aborted.set()
                self.scheduler.wake()

        handle._abort_cb = abort
        self.scheduler.add(req)
        return handle

    # -- administration --------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        self._require_ready()
        kv = self.runner.kv
        return {"expert_cache": self.runner.expert_stats(),
                "kv": {"blocks_total": kv.num_blocks, "blocks_used": kv.used_blocks,
                       "block_size": kv.block_size, "prefix_cached_blocks": self.scheduler.radix.cached_blocks()},
                "device": self.runner.device.type, "device_bytes": self.runner.device_bytes()}

    async def resize_expert_cache(self, experts: int | None = None, bytes: int | None = None) -> dict:
        """Resize at the next safe point; returns ``cache_stats()`` once the size is in force."""
        self._require_ready()
        if (experts is None) == (bytes is None):
            raise InvalidRequest("give exactly one of expert_cache_experts or expert_cache_bytes")
        if self.runner.cache is None:
            raise InvalidRequest("this model has no routed experts to cache")
        n = experts if experts is not None else bytes // self.runner.bank.expert_bytes
        await asyncio.wrap_future(self.scheduler.call(lambda: self.runner.resize_expert_cache(n)))
        return self.cache_stats()

    def calibrate(self, measure: bool = False, pcie_gbps: float | None = None,
                  cpu_expert_gbps: float | None = None, fill_fraction: float | None = None) -> dict:
        """Set (or re-measure) the bandwidths behind q*; applied at the next safe point."""
        self._require_ready()
        if measure:
            from ..calibrate import load_or_measure
            result = load_or_measure(self.runner.device, refresh=True)
        else:
            result = dict(self._calibration)
            if pcie_gbps is not None or cpu_expert_gbps is not None:
                from ..calibrate import fill_fraction as split
                result.update(pcie_gbps=pcie_gbps, cpu_expert_gbps=cpu_expert_gbps)
                if cpu_expert_gbps:
                    result["fill_fraction"] = split(pcie_gbps, cpu_expert_gbps)
            if fill_fraction is not None:
                result["fill_fraction"] = fill_fraction
        f = float(result["fill_fraction"])
        if not 0.0 <= f <= 1.0:
            raise InvalidRequest(f"fill_fraction must be within 0..1, got {f}")
        if self.runner.cache is not None:
            self.scheduler.call(lambda: self.runner.set_fill_fraction(f)).result(timeout=60)
        self._calibration = result
        return dict(result)

    def stats(self) -> dict:
        if self._status != "ok":
            return {}
        sch, kv = self.scheduler, self.runner.kv
        c = sch.counters
        return {"running": len(sch.running), "queued": len(sch.waiting),
                "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.used_blocks,
                "kv_window_blocks_total": kv.window_blocks, "kv_window_blocks_used": kv.used_window_blocks,
                "prefix_hit_ratio": c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "prompt_tokens": c["prompt_tokens"], "cached_tokens": c["cached_tokens"],
                "generated_tokens": c["generated_tokens"], "preemptions": c["preemptions"],
                "decode_steps_beside": c["decode_steps_beside"],
                "decode_beside_seconds": round(c["decode_beside_seconds"], 6),
                "anchor_checkpoints": c["anchor_checkpoints"], "anchor_resumes": c["anchor_resumes"],
                "anchor_resumed_tokens": c["anchor_resumed_tokens"],
                "anchor_checkpoints_held": len(sch.anchors) if sch.anchors is not None else 0,
                "draft_tokens": c["draft_tokens"], "draft_tokens_kept": c["draft_tokens_kept"],
                "draft_steps": c["draft_steps"],
                "pcie_gbps": self._calibration.get("pcie_gbps"),
                "cpu_expert_gbps": self._calibration.get("cpu_expert_gbps"),
                "fill_fraction": self._calibration.get("fill_fraction"),
                "expert_cache": self.runner.expert_stats(), "device_bytes": self.runner.device_bytes(),
                **self.runner.graph_stats()}

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()


__all__ = ["EngineService", "SamplingParams"]
