"""The expert bank: every routed expert in host memory, the source of truth.

One tensor per projection with ``[moe_layer, expert]`` leading dimensions, filled in its final
layout (gate and up fused as ``w13``) and pinned afterwards when CUDA is present, so that cache
fills and prefill streaming copy straight from it over PCIe.
"""
from __future__ import annotations

import torch

from ..kernels.mxfp4 import row_bytes

_PAGE = 4096
_REGISTER_MIN = 2 << 20


def _page_aligned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor on its own page-aligned mapping, so that ``pin`` registers it in
    place: ``torch.empty`` memory starts 16 bytes into a page and would need a pinned copy (a
    second 60 GB for a large bank)."""
    from ..packed.memory import aligned_empty
    n = 1
    for d in shape:
        n *= d
    return aligned_empty(n * torch.empty((), dtype=dtype).element_size()).view(dtype).view(shape)


def _register_in_place(t: torch.Tensor, registered: list[int]) -> bool:
    """Page-lock ``t`` where it lies. A mapping from ``aligned_empty`` is unregistered when the
    mapping goes; any other address is remembered in ``registered`` for ``unpin``."""
    from ..packed.format import PackedFormatError
    from ..packed.memory import clear_cuda_error, host_register
    try:
        return bool(host_register(t))
    except ValueError:                      # not such a mapping: register the address itself
        pass
    except PackedFormatError:               # host_register cleared CUDA's error already
        return False
    if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0:
        registered.append(t.data_ptr())
        return True
    clear_cuda_error()
    return False


class ExpertBank:
    def __init__(self, num_layers: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 w13: torch.Tensor | None = None, w2: torch.Tensor | None = None, mxfp4: bool = False,
                 store: torch.dtype | None = None):
        """Allocate an empty bank, or adopt ``w13``/``w2`` already in the final layout (a packed
        checkpoint read straight into place). ``dtype``: the model's; the weights' too, unless
        ``mxfp4``: the experts then stay in 4 bits, each row of K values as ``kernels/mxfp4.py``'s
        ``mxfp4.row_bytes(K)`` bytes (rb; uint8 ``[L, E, 2I, rb(H)]`` and ``[L, E, H, rb(I)]``),
        or ``store``: the dense weights' dtype when it is not the model's (a CPU engine computing
        in float32 keeps a checkpoint's bfloat16 experts as they are: ``models/build.bank_store``)."""
        self.num_layers, self.num_experts, self.hidden, self.inter = num_layers, num_experts, hidden, inter
        self.dtype, self.mxfp4 = dtype, mxfp4
        store = torch.uint8 if mxfp4 else store or dtype
        k13, k2 = (row_bytes(hidden), row_bytes(inter)) if mxfp4 else (hidden, inter)
        shape13, shape2 = (num_layers, num_experts, 2 * inter, k13), (num_layers, num_experts, hidden, k2)
        if w13 is None:
            w13, w2 = _page_aligned(shape13, store), _page_aligned(shape2, store)
        elif tuple(w13.shape) != shape13 or tuple(w2.shape) != shape2 or w13.dtype != store:
            raise ValueError(f"bank tensors {tuple(w13.shape)} {w13.dtype} do not match {shape13} {store}")
        self.w13 = w13      # [L, E, 2I, H]: gate ; up  (MXFP4: rows of rb(H) bytes)
        self.w2 = w2        # [L, E, H, I]: down        (MXFP4: rows of rb(I) bytes)
        self.pinned = False

    @property
    def store(self) -> torch.dtype:
        """The dtype the weights are held in (uint8 for MXFP4 rows)."""
        return self.w13.dtype

    @staticmethod
    def nbytes_for(num_layers: int, num_experts: int, hidden: int, inter: int, store: torch.dtype,
                   mxfp4: bool = False) -> int:
        """Bytes of such a bank (``store``: its dense weights' dtype), before making it."""
        if mxfp4:
            return num_layers * num_experts * (2 * inter * row_bytes(hidden) + hidden * row_bytes(inter))
        return num_layers * num_experts * 3 * hidden * inter * store.itemsize

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (all three projections), as stored."""
        return (self.w13[0, 0].numel() + self.w2[0, 0].numel()) * self.w13.element_size()

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    def cpu_rate(self, seconds: float) -> float:
        """GB/s of this bank's expert rows that the compiled CPU kernel reads in one-expert calls
        run back to back from C (as the CPU branch runs a step's misses), random experts, layer
        after layer, for about ``seconds``."""
        return self._call_rate(1, seconds)

    def cpu_call_speed(self, seconds: float, sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
                       one: float | None = None) -> tuple[float, ...]:
        """The CPU's call-size curve on this bank (``kernels/split.py``): the compiled kernel's
        rate on calls of each of ``sizes`` distinct random experts (one token), about ``seconds``
        each, over the rate of one-expert calls; sizes above the expert count are left out.
        ``one``: the one-expert rate ``cpu_rate`` has just measured (not measured again)."""
        from ..kernels.split import speed_curve
        return speed_curve({n: one if n == 1 and one else self._call_rate(n, seconds)
                            for n in sizes if n <= self.num_experts})

    def _call_rate(self, n: int, seconds: float) -> float:
        """GB/s of calls of ``n`` distinct random experts (one token) run back to back from C."""
        from ..kernels import cpu_experts
        x, tok = torch.zeros(1, self.hidden, dtype=self.dtype), torch.zeros(n, dtype=torch.int64)
        gen = torch.Generator().manual_seed(n)
        experts, busy, layer = 0, 0.0, 0
        while busy < seconds:
            exps = torch.stack([torch.randperm(self.num_experts, generator=gen)[:n] for _ in range(max(2, 16 // n))])
            busy += cpu_experts.calls_seconds(x, self.w13[layer], self.w2[layer], tok, exps)
            experts, layer = experts + exps.numel(), (layer + 1) % self.num_layers
        return experts * self.expert_bytes / busy / 1e9

    def widened(self) -> "ExpertBank":
        """This bank with its dense weights in the model's dtype (a copy, exact), for a checkpoint
        whose later experts are stored wider than the first one that chose ``store``."""
        bank = ExpertBank(self.num_layers, self.num_experts, self.hidden, self.inter, self.dtype)
        bank.w13.copy_(self.w13)
        bank.w2.copy_(self.w2)
        return bank

    def fill(self, layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy one expert's ``gate [I,H]``, ``up [I,H]``, ``down [H,I]`` into its final place
        (an MXFP4 bank takes them as MXFP4 rows, ``[I, rb(H)]`` and ``[H, rb(I)]`` uint8)."""
        if self.mxfp4 and gate.dtype != torch.uint8:
            raise ValueError(f"an MXFP4 bank takes MXFP4 rows (uint8), got {gate.dtype}")
        i = self.inter
        self.w13[layer, expert, :i].copy_(gate)
        self.w13[layer, expert, i:].copy_(up)
        self.w2[layer, expert].copy_(down)

    def pin(self) -> None:
        """Page-lock the bank (after filling: pinning first would slow the fill) when CUDA exists."""
        if self.pinned or not torch.cuda.is_available():
            return
        self._registered = []
        for name in ("w13", "w2"):
            t = getattr(self, name)
            size = t.numel() * t.element_size()
            # Register large, page-aligned banks in place (no second copy of a 60 GB bank);
            # registration is page-granular, so small tensors sharing pages get a pinned copy.
            if size >= _REGISTER_MIN and t.data_ptr() % _PAGE == 0 and _register_in_place(t, self._registered):
                continue
            setattr(self, name, t.pin_memory())
        self.pinned = True

    def unpin(self) -> None:
        """Unregister memory that was registered by address (also done when the bank is
        garbage-collected), so a later allocation at the same addresses can be registered again.
        A bank on its own mappings (the default) is unregistered when its mappings go."""
        if getattr(self, "_registered", None) and torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            failed = [ptr for ptr in self._registered if int(cudart.cudaHostUnregister(ptr)) != 0]
            if failed:          # not registered any more (a CUDA reset): clear the sticky error
                from ..packed.memory import clear_cuda_error
                clear_cuda_error()
        self._registered = []

    def __del__(self):
        try:
            self.unpin()
        except Exception:  # interpreter shutdown: CUDA may already be gone
            pass
