"""Weight blocks as GGUF defines them (llama.cpp's ggml-common.h): 32 weights of a row share one scale, stored
beside them, and each weight is a few bits. A block is a row of bytes; a weight matrix [N, K] is N rows of K / 32
blocks, in nn.Linear's layout, so a row of blocks is a row of the matrix.

    Q8_0  fp16 d | 32 int8 q                        34 bytes, 8.5 bits a weight    w = d * q
    Q4_1  fp16 d | fp16 m | 16 bytes, two q a byte   20 bytes, 5 bits a weight      w = d * q + m     (q in 0..15)
    Q4_0  fp16 d | 16 bytes, two q a byte           18 bytes, 4.5 bits a weight    w = d * (q - 8)

The 4-bit formats split their nibbles: byte j holds weight j in its low four bits and weight j + 16 in its high
four, so the first half of a block is every byte's low nibble and the second half every high nibble (one mask or
one shift unpacks sixteen weights). Q4_0 is symmetric around zero (its offset is the constant 8); Q4_1 stores the
block's minimum m, so a block of all-positive weights keeps all sixteen levels. The course reads Q8_0 and Q4_1,
the two formats SmolLM2's shipped file holds; Q4_0 differs from Q4_1 only by the fixed offset.

`quantize` writes blocks exactly as the `gguf` package's reference quantizer does (tests/test_l16_blocks.py checks
the bytes); `dequantize` spells the arithmetic out, and shared/cpu_ops.cpp's kernel does the same in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.errors import CourseError

BLOCK = 32  # weights a block: every format here


@dataclass(frozen=True)
class Format:
    name: str
    block_bytes: int  # a block of BLOCK weights, its scales included

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / BLOCK

    def row_bytes(self, k: int) -> int:
        """A row of K weights in this format (K a multiple of BLOCK)."""
        return k // BLOCK * self.block_bytes


FORMATS = {"q8_0": Format("q8_0", 34), "q4_1": Format("q4_1", 20)}


def check_format(name: str) -> Format:
    if name not in FORMATS:
        raise CourseError(f"unknown block format {name!r}: use {' or '.join(FORMATS)}")
    return FORMATS[name]


def _halves(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n] -> the fp16 values' bytes [n, 2] (little-endian, as GGUF stores them)."""
    return x.to(torch.float16).view(torch.uint8).view(-1, 2)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds halves to even). Not floor(|x| + 0.5): for the float
    just below 0.5 that sum rounds up to 1.0; the fraction, doubled, is exact (gguf's np_roundf does the same)."""
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + torch.floor(2 * (a - whole)))


# Task L16.1: quantize a weight matrix into GGUF blocks and read them back, as the gguf package does
def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w [N, K] (fp32 or bf16, K a multiple of 32) -> uint8 blocks [N, K / 32 * block bytes], byte for byte what
    gguf.quants.quantize writes. The scale is computed in fp32 and stored as fp16; each q is rounded with the fp32
    scale, as llama.cpp's reference quantizer does."""
    f = check_format(fmt)
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise CourseError(f"quantize takes a matrix [N, K] with K a multiple of {BLOCK}, got {list(w.shape)}")
    n, k = w.shape
    x = w.detach().to(torch.float32).reshape(-1, BLOCK)  # one block a row
    if f.name == "q8_0":
        d = x.abs().amax(1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = round_half_away(x * inv).to(torch.int8)
        out = torch.cat([_halves(d.flatten()), q.view(torch.uint8)], 1)
    else:
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        nibbles = q[:, :16] | (q[:, 16:] << 4)  # byte j: weight j low, weight j + 16 high
        out = torch.cat([_halves(d.flatten()), _halves(lo.flatten()), nibbles], 1)
    return out.reshape(n, f.row_bytes(k)).contiguous()


# Task L16.1: quantize a weight matrix into GGUF blocks and read them back, as the gguf package does
def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 blocks [N, bytes] -> fp32 [N, K]: every weight as gguf computes it (the fp16 scales widened exactly,
    d * q exact in fp32, + m rounded once). The kernel computes the same values without writing them out."""
    f = check_format(fmt)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % f.block_bytes:
        raise CourseError(f"{fmt} blocks are uint8 [N, a multiple of {f.block_bytes} bytes], got "
                          f"{str(blocks.dtype).removeprefix('torch.')} {list(blocks.shape)}")
    n = blocks.shape[0]
    b = blocks.reshape(-1, f.block_bytes)
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if f.name == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).float()
        w = d * q
    else:
        m = b[:, 2:4].contiguous().view(torch.float16).float()
        nib = b[:, 4:]
        q = torch.cat([nib & 15, nib >> 4], 1).float()  # low nibbles are weights 0-15, high ones 16-31
        w = d * q + m  # d * q is exact in fp32: only the sum rounds, as in gguf
    return w.reshape(n, -1)
