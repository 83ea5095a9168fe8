"""L6's block manager, with its one pool write made part of the next step.

Copy-on-write is the only time the scheduler itself writes the pool (it copies a shared block before a
fork's child writes into it). With tensor parallelism every rank holds its own heads of every block, so
every rank must make the copy, and only rank 0 runs the scheduler. So the copy is recorded here, sent with
the next step, and made by every rank before that step's first write (runner.py). Nothing writes the pool
between a schedule and its forward, so making the copy later changes nothing.
"""
from __future__ import annotations

from lessons.l6_prefix_sharing.block_manager import RefBlockManager


class DeferredCopyManager(RefBlockManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids, in the order they were made

    # Task L10.7: rank 0 sends each step, its deferred copies too; every rank runs it
    def copy_block(self, src: int, dst: int) -> None:
        self.pending_copies.append((src, dst))

    # Task L10.7: rank 0 sends each step, its deferred copies too; every rank runs it
    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
