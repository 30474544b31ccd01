"""The sizes of kernels/mxfp4.py's rows, without torch: the packed format's reader checks a folder
before torch is imported (packed/early.py)."""
from __future__ import annotations

#: a row's bytes are a multiple of this (its codes, its scales, zero padding)
ROW_ALIGN = 16


def row_bytes(k: int) -> int:
    """Bytes of an MXFP4 row of ``k`` values: K/2 codes, K/32 scales, padded to ``ROW_ALIGN``."""
    if k % 32 or k <= 0:
        raise ValueError(f"MXFP4 rows hold a positive multiple of 32 values, got {k}")
    return k // 2 + -(-(k // 32) // ROW_ALIGN) * ROW_ALIGN


def values_in(nbytes: int) -> int | None:
    """Values of an MXFP4 row of ``nbytes`` bytes (the inverse of ``row_bytes``), None for a size
    no row has."""
    if nbytes <= 0 or nbytes % ROW_ALIGN:
        return None
    blocks = nbytes // 17              # 17 g <= row_bytes(32 g) < 17 g + 16: the only candidate
    return 32 * blocks if blocks > 0 and row_bytes(32 * blocks) == nbytes else None


def row_values(nbytes: int) -> int:
    """Values of an MXFP4 row of ``nbytes`` bytes; ValueError for a size no row has."""
    k = values_in(nbytes)
    if k is None:
        raise ValueError(f"{nbytes} bytes is no MXFP4 row (K/2 + K/32 bytes padded to a multiple of "
                         f"{ROW_ALIGN}, for K a multiple of 32)")
    return k
