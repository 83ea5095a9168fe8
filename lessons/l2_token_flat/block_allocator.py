"""A free list of block IDs. All or nothing: a request either gets every block it asked for, or none."""
from __future__ import annotations

from collections import deque

from shared.errors import PoolExhausted


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks  # O(1) double-free check

    @property
    def num_free(self) -> int:
        return len(self._free)

    # Task L2.1: hand out n free block ids, all or nothing; take them back, checked
    def alloc(self, n: int) -> list[int]:
        """n ids from the front of the free list. All or nothing: too few free raises PoolExhausted(needed=n, ...)."""
        if n > len(self._free):
            raise PoolExhausted(needed=n, free=len(self._free), total=self.num_blocks)
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    # Task L2.1: hand out n free block ids, all or nothing; take them back, checked
    def free(self, blocks: list[int]) -> None:
        """Each to the back of the free list (reused last). All checked first, nothing freed on error: ValueError
        "block {b} is not in this pool (0..{last})" or "block {b} freed twice"."""
        seen: set[int] = set()
        for b in blocks:
            if not 0 <= b < self.num_blocks:  # -1 would silently index _is_free from the end
                raise ValueError(f"block {b} is not in this pool (0..{self.num_blocks - 1})")
            if self._is_free[b] or b in seen:
                raise ValueError(f"block {b} freed twice")
            seen.add(b)
        for b in blocks:
            self._is_free[b] = True
            self._free.append(b)
