"""Triton kernels for the GPU path, each tested against its PyTorch reference.

- ``moe.moe_slots_forward``: routed expert pairs computed from the expert cache's slot pool
  (fused gate/up + SwiGLU, then down; bf16 weights, float32 accumulation).
- ``control.control_step``: one MoE layer's cache control step on the device (deduplicate,
  classify, split misses into fills and CPU work, pick LRU victims, rewrite routing to slots),
  with fixed-size outputs so that a decode step needs no host sync and can be graph-captured.
- ``gather.gather_fill_rows``: the step's fills copied from the pinned host bank into their
  victim slots by one kernel that reads mapped pinned memory (no host-known addresses needed).

Every launcher checks shapes, dtypes and strides before launching and raises ``ValueError``.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (how CI tests them).
"""
