"""FreeToken engine: exact MoE inference over a host expert bank and a shared expert cache.

Data flow of one request (each arrow is one typed object, documented where it is defined):

    HTTP request (server/) -> Request (scheduler/request.py, token ids + SamplingParams)
      -> scheduled batch of SeqChunk (executor/inputs.py) -> ForwardInputs on the device
      -> DecoderLM forward (models/decoder.py; MoE layers call cache/offload.py)
      -> logits [B, V] -> sampler (executor/sampler.py) -> TokenEvent stream back to the client

Layers import downward only: server -> scheduler -> executor -> models -> layers -> kernels;
``cache`` never imports ``models``.
"""
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
