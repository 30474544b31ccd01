"""Compiled CPU expert kernel: C++ sources and their build-on-first-use loader (``build.py``).

The public API is ``freetoken_engine.kernels.cpu_experts``; nothing here is imported eagerly.
"""
