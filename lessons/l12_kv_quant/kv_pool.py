"""The int8 pool: L3's block tensors, with each KV head's row stored as int8 codes and its scale.

Per layer, K and V of shape [num_blocks, block_size, Hkv, D + 4] int8: a row is D codes then its fp32
scale's 4 bytes (quantize.pack_rows). Because the scale sits in the row, everything that moves a block
moves its scales with it, unchanged: copy-on-write (L6), swap out and in (L5), the followers' copies (L10);
the prefix cache (L6) and speculative rollback (L11) only move block ids and counts, never bytes. Writes keep
L2's slot convention; `write` quantizes on the way in, and attention reads the codes where they lie.
"""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.kv_pool import BlockKvPool
from lessons.l12_kv_quant.quantize import SCALE_BYTES, pack_rows
from shared.config import Qwen3Config


class Int8KvPool(BlockKvPool):
    # Task L12.3: the int8 pool: K and V int8 [N, S, Hkv, D + 4] per layer; write packs rows [T, Hkv, D] into slots [T]
    def __init__(self, cfg: Qwen3Config, num_blocks: int, block_size: int, device: torch.device):
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim + SCALE_BYTES)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(cfg.num_hidden_layers)]

    # Task L12.3: the int8 pool: K and V int8 [N, S, Hkv, D + 4] per layer; write packs rows [T, Hkv, D] into slots [T]
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v [T, Hkv, D] in the model's dtype -> packed int8 rows at flat slots [T]."""
        row = k.shape[2] + SCALE_BYTES
        self.k[layer].view(-1, k.shape[1], row)[slot_mapping] = pack_rows(k)
        self.v[layer].view(-1, v.shape[1], row)[slot_mapping] = pack_rows(v)


# Task L12.5: size the pool in bytes: one block's K and V over every layer (int8 rows D + 4 wide), whole blocks in kv_bytes
def block_bytes(cfg: Qwen3Config, block_size: int, kv_dtype: torch.dtype) -> int:
    """One block's K and V over every layer: int8 rows carry their scale, other dtypes D values each (fp8: D bytes,
    its scales are one per layer, not per row)."""
    row = cfg.head_dim + SCALE_BYTES if kv_dtype == torch.int8 else cfg.head_dim * kv_dtype.itemsize
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * row
