"""The engine's start of the q* follower: the CPU's rate on this model's experts and its curve by
call size, from this host's cache or measured on the bank (executor/cpu_contention.py,
kernels/split.py)."""
from __future__ import annotations

import logging

from .cpu_contention import ContentionFollower, pool_record

log = logging.getLogger(__name__)


def expert_shape(bank) -> str:
    """The cache's name for a bank's expert shape, e.g. ``2048x768-bfloat16``."""
    return f"{bank.hidden}x{bank.inter}-{'mxfp4' if bank.mxfp4 else str(bank.dtype).removeprefix('torch.')}"


def start_follower(runner, cfg, rest) -> None:
    """Where a split exists (an expert cache on a GPU; it looks only while the cache misses some
    expert), the user did not fix it, the split tuner is off (it moves q itself) and the compiled
    CPU kernel runs the misses: make ``runner.follower`` and apply its split with the CPU's
    call-size curve. The rate and the curve come from this host's cache
    (``calibrate.cached_model_rate``), else they are measured on the bank now (0.2 s and 0.5 s; a
    first start waits for the bank's read for them, as for the calibration) and cached unless
    another process was on the CPUs meanwhile."""
    if not (cfg.cpu_rate_probe and runner.cache is not None and runner.device.type == "cuda"
            and cfg.cpu_expert_fraction is None and runner.tuner is None):
        return
    from ..calibrate import cached_call_speed, cached_model_rate, save_model_rate
    from ..kernels import cpu_experts
    if not cpu_experts.available():
        return
    shape = expert_shape(runner.bank)
    known = cached_model_rate(runner.device, shape)
    speed = cached_call_speed(runner.device, shape) if known is not None else None
    if speed is None and rest.pending:       # something to measure on the bank: its read ends first
        rest.finish()
    runner.follower = f = ContentionFollower(runner.cache.fill_fraction, pool_record,
                                             lambda s: runner.experts.cpu_rate(s),
                                             calibrated_gbps=runner._calibrated_gbps, reference=known)
    if speed is None:         # 0.1 s a call size; a reference measured just now is its 1-expert rate
        speed = runner.bank.cpu_call_speed(f.cfg.probe_s / 2, one=f.reference if known is None else None)
        if not f.reference_contended:
            save_model_rate(runner.device, shape, f.reference, speed)
    runner.cache.cpu_speed = speed
    q = f.effective()
    log.info("CPU expert rate on this model's experts: %.2fx the calibrated one, %s by experts per call; "
             "fill fraction %.3f -> %.3f", f.model_ratio, "/".join(f"{v:.2f}" for v in speed),
             runner.cache.fill_fraction, q)
    runner._set_q(q)         # the curve changes the fill table even where q stays
