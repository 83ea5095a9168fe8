"""The model's matrices as weight blocks: a Linear and an Embedding that hold GGUF blocks and never an fp32 copy.

A decode step's few rows (at most FEW_ROWS) go through the block kernel (shared/cpu_ops.cpp, `linear_blocks`):
each weight is read once as its 4 or 8 bits and dequantized in registers, and every output is bitwise what the
fp32 kernel computes over the dequantized matrix. A prefill's many rows take torch's GEMM over the matrix
dequantized for that one call (compute, not memory, bounds a prefill, so reading 4 bits saves it little), freed
when the call returns: the same values and the same GEMM as the fp32 model's, so those rows are bitwise too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lessons.l16_weight_quant.blocks import check_format, dequantize
from shared.cpu_ops import FEW_ROWS, ops_for


class QuantLinear(nn.Module):
    """x [..., K] fp32 -> x W^T [..., N] fp32, W held as uint8 blocks [N, K / 32 * block bytes]."""

    def __init__(self, blocks: torch.Tensor, fmt: str, in_features: int):
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.shape[1] != check_format(fmt).row_bytes(in_features):
            raise ValueError(f"{fmt} blocks for rows of {in_features} weights: got {blocks.dtype} {list(blocks.shape)}")
        self.register_buffer("blocks", blocks)
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self.every_row = False  # L14's mode: the block kernel for every row count (its order is per row)
        ops_for(torch.empty(0))  # built now (once per cache), not in the first step

    @property
    def weight(self) -> torch.Tensor:
        """An empty fp32 tensor on the blocks' device: the engines of L1-L15 read `lm_head.weight` for the model's
        device and compute dtype, and that is all this answers. The weights are `blocks`."""
        return torch.empty(0, dtype=torch.float32, device=self.blocks.device)

    # Task L16.3: the forwards: the block kernel for a decode's few rows, torch's GEMM over a dequantized copy beyond
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x)
        if ops is None:  # $PAGED_COURSE_CPU_OPS=0 or no compiler: torch over the weights, as the fp32 model then runs
            return F.linear(x, dequantize(self.blocks, self.fmt))
        if self.every_row or x.numel() <= FEW_ROWS * self.in_features:
            return ops.linear_blocks(x, self.blocks, self.fmt)
        return F.linear(x, ops.dequantize(self.blocks, self.fmt, self.in_features))

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


class QuantEmbedding(nn.Module):
    """ids [T] -> the rows of the embedding [T, E] fp32, dequantized from their blocks (only those rows)."""

    def __init__(self, blocks: torch.Tensor, fmt: str, embedding_dim: int):
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.fmt, self.embedding_dim = fmt, embedding_dim

    # Task L16.3: the forwards: the block kernel for a decode's few rows, torch's GEMM over a dequantized copy beyond
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids]
        ops = ops_for(torch.empty(0))  # the ops take fp32 on the CPU: an fp32 probe asks whether they are on
        return dequantize(rows, self.fmt) if ops is None else ops.dequantize(rows, self.fmt, self.embedding_dim)
