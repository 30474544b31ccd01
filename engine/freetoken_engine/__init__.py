"""FreeToken engine: exact MoE inference over a host expert bank and a shared expert cache.

Data flow of one request (each arrow is one typed object, documented where it is defined):

    HTTP request (server/) -> Request (scheduler/request.py, token ids + SamplingParams)
      -> scheduled batch of SeqChunk (executor/inputs.py) -> ForwardInputs on the device
      -> DecoderLM forward (models/decoder.py; MoE layers call cache/offload.py)
      -> logits [B, V] -> sampler (executor/sampler.py) -> TokenEvent stream back to the client

Layers import downward only: server -> scheduler -> executor -> models -> layers -> kernels;
``cache`` never imports ``models``.
"""
import os
import sys

# Before torch (and its OpenMP runtime) loads, if it has not yet: idle OpenMP workers sleep instead
# of spinning. Spinning workers make every op ~20x slower when a game, a browser or another engine
# shares the cores (measured on the 2-core CI machine), and they take the cores the compiled CPU
# kernel's own workers need (executor/host_threads.py); sleeping costs a few microseconds per
# parallel op. A program that imports torch first keeps torch's default (set the variable itself).
#: True when torch loaded before this package with the variable unset: its OpenMP workers then
#: spin (libgomp's default), and a CPU engine says so once at start (executor/host_threads.py)
TORCH_FIRST = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "Generation", "SamplingParams", "preload"]


def __getattr__(name: str):
    # Lazy: ``import freetoken_engine.x`` stays light and no lower layer imports the top API.
    if name == "SamplingParams":
        from .executor.sampler import SamplingParams
        return SamplingParams
    if name == "preload":         # torch-free: call it first, so a packed bank's read overlaps the imports
        from .packed.early import preload
        return preload
    if name in ("LLM", "Generation"):
        from . import llm
        return getattr(llm, name)
    raise AttributeError(name)
