"""L8's scheduler, then room for drafts: each decode may take up to K more tokens of what the step left.

Drafts come last. The step is scheduled exactly as L8 schedules it (decodes, prompt slices, admissions);
then each decode, in the order L8 fed them, gets up to K draft tokens from the budget still unspent, and
the blocks for them, from blocks nobody holds or caches. So a request with k drafts costs k + 1 tokens
of the budget, and when the budget or the pool is short k shrinks, down to a plain decode: speculation
never delays a prompt, never evicts a request, never evicts a cached prefix. k also stops one short of
the request's max_tokens (the target's own token follows the drafts), which keeps every position written
inside what admission promised (`max_blocks`) and the model's context.
"""
from __future__ import annotations

from lessons.l2_token_flat.engine import blocks_for
from lessons.l8_chunked_prefill.scheduler import ChunkedScheduler
from lessons.l8_chunked_prefill.slice import Slice


class SpecScheduler(ChunkedScheduler):
    def __init__(self, *args, num_speculative_tokens: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_speculative_tokens = num_speculative_tokens
        self.limits: list[int] = []  # per slice of the last plan: the drafts its blocks were reserved for

    def schedule(self) -> list[Slice]:
        plan = super().schedule()
        self.limits = [self.draft_room(piece) if piece.decode else 0 for piece in plan]
        return plan

    # Task L11.5: room for up to K drafts behind a decode from the budget left and unheld free blocks; reserve them
    def draft_room(self, piece: Slice) -> int:
        """Reserve blocks for up to K drafts behind this decode; returns how many it may carry."""
        seq = piece.seq
        n = seq.num_tokens
        k = min(self.num_speculative_tokens, self.budget, seq.stop.max_new_tokens - len(seq.output_ids) - 1)
        unheld = self.allocator.num_free - self.allocator.num_cached_unheld  # free, and nobody's prefix
        k = min(k, (len(seq.blocks) + unheld) * self.block_size - n)
        if k <= 0:
            return 0
        seq.reserve(n + k, self.allocator)  # cannot fail: counted above; the decode already copied a shared block
        self.budget -= k
        return k

    # Task L11.6: roll back after verification: num_cached = end - 1, free the blocks wholly past blocks_for(end)
    def roll_back(self, seq, end: int) -> None:
        """After verification: the request's history ends at `end` (its committed tokens). Blocks wholly past
        the last one it feeds next step go back to the pool; the rejected drafts' K/V left in its last block is
        garbage the next step overwrites (the kernels read only the first num_cached + fed positions)."""
        seq.num_cached = end - 1
        keep = blocks_for(end, self.block_size)
        if len(seq.blocks) > keep:
            tail = seq.blocks[keep:]
            seq.blocks = seq.blocks[:keep]  # a new list, never cut in place: kept tables notice (L4, L10)
            self.allocator.free(tail)
