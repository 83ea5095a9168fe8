"""L4's Sequence whose block table may share blocks: before it writes into a shared block, it copies it."""
from __future__ import annotations

from dataclasses import dataclass

from lessons.l2_token_flat.engine import blocks_for
from lessons.l4_continuous.sequence import Sequence
from shared.errors import PoolExhausted


@dataclass(eq=False)
class SharedSequence(Sequence):
    # Task L6.3: copy-on-write: before a write into a shared block, copy it (every layer, K and V) and take the copy
    def reserve(self, num_tokens: int, allocator) -> None:
        """Grow the table to `num_tokens` tokens, and make private the block the next write lands in.

        Only a fork leaves a shared block with room in it (its children share the prompt's partly filled
        last block); a cache hit shares full blocks only. All or nothing: PoolExhausted changes nothing.
        Copy-on-write gives the table a new list: a table list only ever grows in place (L4's TableTensor
        and L10's follower copies rely on it).
        """
        i = self.num_cached // self.block_size  # the block position num_cached is written into
        cow = i < len(self.blocks) and allocator.is_shared(self.blocks[i])
        grow = max(0, blocks_for(num_tokens, self.block_size) - len(self.blocks))
        if grow + cow > allocator.num_free:
            raise PoolExhausted(needed=grow + cow, free=allocator.num_free, total=allocator.num_blocks)
        if cow:
            self.blocks = self.blocks.copy()
            self.blocks[i] = allocator.copy_on_write(self.blocks[i])
        if grow:
            self.blocks += allocator.alloc(grow)

    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids
