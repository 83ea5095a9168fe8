"""The swap space: a host-memory copy of the device pool's block layout, with its own free list.

Per layer, K and V of shape [num_host_blocks, S, Hkv, D] on the CPU (pinned when the device is a GPU, so
the copies can run at full PCIe speed). A swapped-out request keeps its host block ids in
`seq.extra["host_blocks"]`; device block ids mean nothing once it has given them back.
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator


class HostKvPool:
    def __init__(self, device_pool, num_host_blocks: int):
        self.device_pool = device_pool  # L3's BlockKvPool: lists .k[layer], .v[layer] of [num_blocks, S, Hkv, D]
        first = device_pool.k[0]
        pin = first.device.type == "cuda"
        shape = (num_host_blocks, *first.shape[1:])
        self.k = [torch.zeros(shape, dtype=first.dtype, pin_memory=pin) for _ in device_pool.k]
        self.v = [torch.zeros(shape, dtype=first.dtype, pin_memory=pin) for _ in device_pool.v]
        self.allocator = BlockAllocator(num_host_blocks)

    # Task L5.1: copy device blocks' pages [S, Hkv, D], every layer's K and V, to fresh host blocks, and back
    def swap_out(self, device_blocks: list[int]) -> list[int]:
        """Copy these device blocks to fresh host blocks; returns the host ids. PoolExhausted if no room (the
        scheduler checks can_hold first and falls back to recompute)."""
        host_blocks = self.allocator.alloc(len(device_blocks))
        src = torch.tensor(device_blocks, device=self.device_pool.k[0].device)
        dst = torch.tensor(host_blocks)
        for dev, host in zip(self.device_pool.k + self.device_pool.v, self.k + self.v):
            host[dst] = dev[src].to("cpu")
        return host_blocks

    # Task L5.1: copy device blocks' pages [S, Hkv, D], every layer's K and V, to fresh host blocks, and back
    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Copy host blocks back into (already allocated) device blocks, in order, and free the host ones."""
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks[: len(host_blocks)], device=self.device_pool.k[0].device)
        for dev, host in zip(self.device_pool.k + self.device_pool.v, self.k + self.v):
            dev[dst] = host[src].to(dev.device, non_blocking=True)
        self.allocator.free(host_blocks)

    def can_hold(self, num_blocks: int) -> bool:
        return num_blocks <= self.allocator.num_free

