"""A request's block table as an int32 tensor kept between steps, so a step pays for its new entries only.

BatchMeta needs every running request's page table as one int32 tensor each step. Converted from the
Python list every step, that costs the whole table: at 32k tokens and 16-token blocks, 2,048 ints per
request per step, most of a decode step's host time at batch 32. Kept here, a step copies only the
entries appended since the last one (one every block_size steps for a decode).

It relies on one rule every lesson keeps: a block table list is only ever appended to (`reserve`). Any
other change assigns a new list (admission, preemption, retirement, a fork, L6's copy-on-write), which
this notices by identity and copies whole, once.
"""
from __future__ import annotations

import torch


class TableTensor:
    def __init__(self) -> None:
        self.of: list[int] | None = None  # the list mirrored (held, so its id cannot be reused by another)
        self.ids = torch.empty(0, dtype=torch.int32)  # [capacity]: entries 0 .. filled-1 equal of[0 .. filled-1]
        self.filled = 0

    # Task L4.1: the block table as int32 [n], kept between steps: copy only the entries appended since the last call
    def first(self, blocks: list[int], n: int) -> torch.Tensor:
        """blocks[:n] as int32 [n]: a view, valid until the next call (BatchMeta concatenates it at once)."""
        if blocks is not self.of:
            self.of, self.filled = blocks, 0
        elif self.filled and blocks[self.filled - 1] != int(self.ids[self.filled - 1]):
            self.filled = 0  # the rule broken (an entry replaced in place): copy whole rather than read stale pages
        if n > self.filled:
            if n > self.ids.numel():  # doubling: a table of n entries is copied O(log n) times in its life
                grown = torch.empty(max(n, 2 * self.ids.numel(), 16), dtype=torch.int32)
                grown[:self.filled] = self.ids[:self.filled]
                self.ids = grown
            self.ids[self.filled:n] = torch.tensor(blocks[self.filled:n], dtype=torch.int32)
            self.filled = n
        return self.ids[:n]
