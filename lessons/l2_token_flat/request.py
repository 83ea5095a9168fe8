"""A request and the blocks that hold its KV. Token p lives at slot blocks[p // S] * S + p % S."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator


@dataclass(eq=False)  # identity, not field-wise, equality: two requests with equal prompts are two requests
class Request:
    prompt_ids: list[int]
    block_size: int
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the block table: logical block i -> physical id
    num_cached: int = 0  # tokens whose K/V are already in the pool

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    # Task L2.3: position -> pool slot through the block table
    def slot(self, pos: int) -> int:
        return self.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    # Task L2.3: position -> pool slot through the block table
    def slots(self, start: int, end: int) -> list[int]:
        """Flat pool slots of positions start .. end-1, in position order."""
        return [self.slot(p) for p in range(start, end)]

    # Task L2.2: grow the block table to cover num_tokens, nothing changed on failure
    def reserve(self, num_tokens: int, allocator: BlockAllocator) -> None:
        """Grow the block table to ceil(num_tokens / S) blocks. All or nothing: PoolExhausted leaves the table and
        the allocator as they were."""
        needed = -(-num_tokens // self.block_size) - len(self.blocks)
        if needed > 0:
            self.blocks += allocator.alloc(needed)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids start .. end-1 of prompt + output. Only those are copied: a decode feeds one token of a
        history that may be 32k long, and joining the two lists first would copy all of it every step."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - n, 0):max(end - n, 0)]

    def block_table_tensor(self, n: int) -> torch.Tensor:
        """The first n entries of the block table, int32: this request's part of BatchMeta's kv_indices.
        Converted afresh each call, which costs the whole table every step; L4's Sequence keeps the tensor
        between steps and only appends to it."""
        return torch.tensor(self.blocks[:n], dtype=torch.int32)
