"""The quantizer: symmetric absmax int8, one scale per token and KV head.

A row x of D values (one token's K or V for one KV head) becomes D int8 codes and one fp32 scale:
    scale = max|x| / 127        code = round(x / scale), in -127 .. 127        x ~ code * scale
so the row's largest value maps to +-127 and every value is off by at most half a step (scale / 2). A row
of zeros gets scale 0 and codes 0, and comes back exactly.

In the pool a row is stored packed: its D codes, then its scale's 4 bytes (pack_rows), so the scale lives
in the same block and slot as the codes it scales. That is llama.cpp's layout too (its q8_0 keeps a block
of 32 codes beside their scale).
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: -128 is never used, so negating a code never overflows
SCALE_BYTES = 4  # an fp32 scale after each row's codes


# Task L12.1: absmax int8, one fp32 scale per row: x [..., D] -> codes [..., D], scales [..., 1]; and back
def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes int8 [..., D], scales fp32 [..., 1]), one scale per row."""
    x = x.float()
    scales = x.abs().amax(dim=-1, keepdim=True) / QMAX
    # A row of zeros: scale 0, and dividing by 1 instead keeps its codes 0 (not NaN).
    codes = torch.round(x / torch.where(scales > 0, scales, 1.0)).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scales


# Task L12.1: absmax int8, one fp32 scale per row: x [..., D] -> codes [..., D], scales [..., 1]; and back
def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The rows back in fp32: code x scale."""
    return codes.float() * scales


# Task L12.2: pack a row as its D codes then its scale's 4 bytes, int8 [..., D + 4]; and unpack it to fp32
def pack_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> int8 [..., D + 4]: each row's codes, then its fp32 scale's bytes."""
    codes, scales = quantize(x)
    return torch.cat([codes, scales.view(torch.int8)], dim=-1)


# Task L12.2: pack a row as its D codes then its scale's 4 bytes, int8 [..., D + 4]; and unpack it to fp32
def unpack_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 [..., D + 4] (pack_rows' layout) -> fp32 [..., D]."""
    d = rows.shape[-1] - SCALE_BYTES
    scales = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]: the 4 bytes read back as one float
    return dequantize(rows[..., :d], scales)
