"""MXFP4 expert rows: the bank's layout for experts kept in 4 bits (gpt-oss as published).

A weight matrix ``[R, K]`` (K a multiple of 32) is stored as ``uint8 [R, row_bytes(K)]``: each
row's K/2 bytes of 4-bit e2m1 codes, then its K/32 scale bytes (a power of two, ``2 ** (s - 127)``,
per block of 32 values), then zero bytes up to a multiple of 16 (gpt-oss's 2,880 values: 1,440 +
90 + 6 = 1,536 bytes), so every row starts 16-byte aligned and a GPU kernel loads a block's codes
16 bytes at a time (kernels/triton/moe_mxfp4.py). The codes of each run of 16 values are 8 bytes,
two little-endian 32-bit words A and B: value 2m in A's nibble m, value 2m + 1 in B's
(``(A >> 4m) & 15``). A vector kernel broadcasts the 8 bytes to every lane, shifts each lane by
its own count and looks the code up: no byte shuffle (kernels/cpu/mxfp4.h). A row's codes and
scales stay together, so an expert is one contiguous run of bytes that copies, caches and pages
like any other row.

The checkpoints' own MXFP4 (``<name>_blocks [..., R, G, 16]`` with values 2j / 2j + 1 in the low /
high nibble of byte j, ``<name>_scales [..., R, G]``) is repacked into it exactly (``from_blocks``);
``dequantize`` gives the values, exactly as models/loader.dequantize_mxfp4 gives them.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .mxfp4_rows import row_bytes, row_values

#: the 16 values of a 4-bit e2m1 float, by code
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(t: torch.Tensor) -> bool:
    """Whether ``t`` holds MXFP4 rows (the bank's only uint8 weights)."""
    return t.dtype == torch.uint8


def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 ``blocks [..., G, 16]`` (value 2j in byte j's low nibble, 2j + 1 in its
    high one) and ``scales [..., G]`` -> rows ``uint8 [..., row_bytes(32 G)]`` in this module's layout."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 \
            or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConfigError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                          f"{scales.dtype} do not fit: expected uint8 [..., G, 16] and uint8 [..., G]")
    lead, groups = tuple(scales.shape[:-1]), scales.shape[-1]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*lead, groups * 32)   # value order
    return _row(_pack(codes), scales)


def _row(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Code bytes ``[..., K/2]`` and scale bytes ``[..., K/32]`` -> whole rows, zero-padded."""
    k = packed.shape[-1] * 2
    pad = packed.new_zeros((*packed.shape[:-1], row_bytes(k) - k // 2 - k // 32))
    return torch.cat((packed, scales, pad), dim=-1)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` in value order (uint8, 0..15) -> the rows' code bytes ``[..., K/2]``."""
    c = codes.reshape(*codes.shape[:-1], -1, 4, 4)          # runs of 16 as 4 x (4i, 4i+1, 4i+2, 4i+3)
    a = c[..., 0] | (c[..., 2] << 4)                         # A's byte i: values 4i, 4i + 2
    b = c[..., 1] | (c[..., 3] << 4)                         # B's byte i: values 4i + 1, 4i + 3
    return torch.cat((a, b), dim=-1).reshape(*codes.shape[:-1], -1)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """The rows' code bytes ``[..., K/2]`` -> codes ``[..., K]`` in value order (int64)."""
    q = packed.reshape(*packed.shape[:-1], -1, 2, 4).to(torch.int64)       # runs of 16: A's bytes, B's
    a, b = q[..., 0, :], q[..., 1, :]
    return torch.stack((a & 15, b & 15, a >> 4, b >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def value_order(k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The values of a row of ``k`` in the order its code bytes hold them (int64 ``[k]``): first
    each byte's low nibble, byte by byte, then each byte's high nibble. Byte b = 8R + 4j + i
    (word j of run R, its byte i) holds value 16R + 4i + 2h + j in nibble h."""
    b = torch.arange(k // 2, device=device)
    low = 16 * (b // 8) + 4 * (b % 4) + (b % 8) // 4
    return torch.cat((low, low + 2))


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 rows ``uint8 [..., row_bytes(K)]`` -> their values ``[..., K]`` in ``dtype``, exact
    (every value is an e2m1 code times a power of two)."""
    k = row_values(rows.shape[-1])
    lead, groups = tuple(rows.shape[:-1]), k // 32
    lut = torch.tensor(E2M1, dtype=torch.float32)
    vals = lut[_codes(rows[..., :k // 2])].reshape(*lead, groups, 32)
    vals = torch.ldexp(vals, rows[..., k // 2:k // 2 + groups].to(torch.int32)[..., None] - 127)
    return vals.reshape(*lead, k).to(dtype)


def random_rows(lead: tuple, k: int, generator: torch.Generator, scales: tuple[int, int] = (118, 124)) -> torch.Tensor:
    """Rows ``uint8 [*lead, row_bytes(k)]`` of random codes, scale bytes drawn from
    ``[scales[0], scales[1])`` (2^-9 to 2^-4 by default) and zero padding: benchmarks' banks."""
    q = torch.randint(0, 256, (*lead, row_bytes(k)), dtype=torch.uint8, generator=generator)
    q[..., k // 2:k // 2 + k // 32] = torch.randint(*scales, (*lead, k // 32), dtype=torch.uint8, generator=generator)
    q[..., k // 2 + k // 32:] = 0
    return q


def quantize(w: torch.Tensor) -> torch.Tensor:
    """Values ``[..., K]`` -> the nearest MXFP4 rows (each block's scale the power of two that
    puts its largest magnitude at or below 6, codes rounded to nearest): random test banks and
    benchmarks. Not a model converter's quantizer: no error compensation."""
    k = w.shape[-1]
    out = torch.empty((*w.shape[:-1], row_bytes(k)), dtype=torch.uint8)
    flat_w, flat_o = w.reshape(-1, k), out.view(-1, out.shape[-1])
    mags = torch.tensor(E2M1[:8])
    step = max(1, (1 << 20) // k)                       # rows a pass: ~1M values
    for r0 in range(0, flat_w.shape[0], step):
        v = flat_w[r0:r0 + step].float().reshape(-1, k // 32, 32)
        amax = v.abs().amax(-1).clamp_min(2.0 ** -126)
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
        scaled = torch.ldexp(v, -exp[..., None])
        code = (scaled.abs()[..., None] - mags).abs().argmin(-1).to(torch.uint8)
        code = code | (torch.signbit(scaled).to(torch.uint8) << 3)
        packed = _pack(code.reshape(v.shape[0], k))
        flat_o[r0:r0 + step] = _row(packed, (exp + 127).to(torch.uint8))
    return out
