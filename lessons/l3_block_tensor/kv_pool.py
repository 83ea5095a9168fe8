"""The block-tensor pool: per layer, K and V of shape [num_blocks, block_size, Hkv, D] (NHD pages).

The same storage viewed as [num_blocks * block_size, Hkv, D] is L2's token-flat pool, so writes keep
L2's slot convention (slot = block * S + offset); only the reads change: kernels take pages, not slots.
"""
from __future__ import annotations

import torch

from shared.config import Qwen3Config


class BlockKvPool:
    # Task L3.1: the pages, K and V [N, S, Hkv, D] per layer; write K/V [T, Hkv, D] by flat slot through a view
    def __init__(self, cfg: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    # Task L3.1: the pages, K and V [N, S, Hkv, D] per layer; write K/V [T, Hkv, D] by flat slot through a view
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, Hkv, D] to flat slots [T]. view() shares storage: the pages see the write."""
        hkv, d = k.shape[1], k.shape[2]
        self.k[layer].view(-1, hkv, d)[slot_mapping] = k
        self.v[layer].view(-1, hkv, d)[slot_mapping] = v

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
