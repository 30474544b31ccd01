"""Expert kernels behind a registry; heavy imports happen inside the factories.

``reference`` (kernels/reference.py) is the readable PyTorch specification and the CPU/CI path.
Compiled CPU kernels and Triton GPU kernels register here and are tested against it. Every
backend computes ``(x, w13, w2, pair_tok, pair_exp) -> [P, H]`` as the reference documents.
"""
from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Callable

from .. import env

ExpertFn = Callable[..., "object"]
log = logging.getLogger(__name__)


def _reference() -> ExpertFn:
    from .reference import expert_pairs_forward
    return expert_pairs_forward


def _compiled_cpu() -> ExpertFn | None:
    try:
        from . import cpu_experts
    except ImportError:
        return None
    return cpu_experts.experts_forward if cpu_experts.available() else None


#: name -> factory returning the function, or None when the backend cannot run here.
CPU_EXPERT_BACKENDS: dict[str, Callable[[], ExpertFn | None]] = {
    "compiled": _compiled_cpu,
    "reference": _reference,
}


def cpu_expert_forward(name: str | None = None) -> tuple[str, ExpertFn]:
    """The CPU expert function to use: ``name``, else $FREETOKEN_CPU_EXPERT_BACKEND, else the
    first backend in ``CPU_EXPERT_BACKENDS`` that is available on this machine."""
    wanted = name or env.cpu_expert_backend()
    order = [wanted] if wanted else list(CPU_EXPERT_BACKENDS)
    for backend in order:
        factory = CPU_EXPERT_BACKENDS.get(backend)
        fn = factory() if factory else None
        if fn is not None:
            return backend, fn
    if wanted:
        log.warning("CPU expert backend %r is not available; using the reference", wanted)
    return "reference", _reference()


@functools.cache
def gpu_decode_kernels(name: str) -> ModuleType | None:
    """``kernels/triton/<name>.py`` (attention, norm, route, combine) for GPU layers' decode, or
    None where Triton is not importable or FREETOKEN_GPU_DECODE_KERNELS leaves it out: torch's
    ops then."""
    if name not in env.gpu_decode_kernels():
        return None
    try:
        return importlib.import_module(f".triton.{name}", __name__)
    except ImportError:
        return None
