"""Shared launcher helpers: interpreter detection and argument checks (real exceptions)."""
from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple, device: torch.device | None = None,
                 inner_contiguous: bool = True) -> None:
    """Raise ValueError unless ``t`` has ``ndim`` dims, a dtype in ``dtypes``, the device and a unit
    stride in its last dimension (what the kernels' pointer arithmetic assumes)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not in {dtypes}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if inner_contiguous and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride in its last dim, got strides {t.stride()}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless ``t`` is contiguous (row-major, the kernels' flat indexing)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")
