"""Triton's interpreter (the CPU runs of the kernels' tests) patches ``triton.language`` once per
kernel launch, and again on every call of a ``@triton.jit`` helper inside the kernel: four
``inspect.getmembers`` walks, about 2 ms, which the launch has already done. In the interpreted
engine tests that repetition was a quarter of the time (12 of 47 s in
``test_prefetch_keeps_the_tokens_across_cache_resizes``). ``install()`` skips a helper's patch
when the launch running it has already patched the same ``triton.language`` modules; everything
else (launches, the patches themselves, their undoing after the launch) is the interpreter's own.

Only the tests use this, and only where the interpreter has the names it wraps; with any other
Triton the interpreter runs unchanged. A wrong skip cannot pass a test silently: a helper that ran
on unpatched builtins would raise (they need the interpreter's semantic)."""
from __future__ import annotations

import inspect

#: launches' patches done, and helpers' patches skipped, since install()
COUNTS = {"patched": 0, "skipped": 0}


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` and ``GridExecutor.__call__``; False if this Triton
    lacks them (nothing changed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    executor = getattr(ti, "GridExecutor", None)
    patch_lang = getattr(ti, "_patch_lang", None)
    scope_type = getattr(ti, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None or getattr(ti, "_ft_once", False):
        return False
    launches: list[set[int]] = []   # per running launch: the language modules it has patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def once(fn):
        wanted = langs(fn)
        if launches and wanted and wanted <= launches[-1]:
            COUNTS["skipped"] += 1
            return scope_type()         # already patched by this launch: nothing to undo either
        COUNTS["patched"] += 1
        scope = patch_lang(fn)
        if launches:
            launches[-1] |= wanted
        return scope

    run = executor.__call__

    def call(self, *args, **kwargs):
        launches.append(set())
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = once
    executor.__call__ = call
    ti._ft_once = True
    return True
