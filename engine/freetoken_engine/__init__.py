"""FreeToken engine: exact MoE inference over a host expert bank and a shared expert cache.

Data flow of one request (each arrow is one typed object, documented where it is defined):

    HTTP request (server/) -> Request (scheduler/request.py, token ids + SamplingParams)
      -> scheduled batch of SeqChunk (executor/inputs.py) -> ForwardInputs on the device
      -> DecoderLM forward (models/decoder.py; MoE layers call cache/offload.py)
      -> logits [B, V] -> sampler (executor/sampler.py) -> TokenEvent stream back to the client

Layers import downward only: server -> scheduler -> executor -> models -> layers -> kernels;
``cache`` never imports ``models``.
"""
from .executor.sampler import SamplingParams
from .llm import LLM, Generation

__all__ = ["LLM", "Generation", "SamplingParams"]
