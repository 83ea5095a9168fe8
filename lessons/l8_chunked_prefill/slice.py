"""What one step computes for one request, shaped as the request L3's runner has always fed.

The runner feeds a request's tokens num_cached .. num_tokens-1 and attends over its first num_tokens
positions. A slice is a request cut short: the first `end` tokens of the real one, num_cached of them
already in the pool, the same block table. So the runner, BatchMeta and every attention backend run a
slice without knowing chunking exists: its queries are the last (end - num_cached) tokens of a history
`end` long, which is the bottom-right causal alignment every backend already uses for a prompt.

A slice holds the request's own token lists and block table, never copies: it is built every step for
every running request, and a copy would cost each decode its whole history (32k ids at 32k tokens).
Only `num_tokens` is cut short, to `end`; whoever reads the tokens asks for num_cached .. end-1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.request import Request
from lessons.l4_continuous.sequence import Sequence


@dataclass(eq=False)
class Slice(Request):
    seq: Sequence | None = None  # the request this slice belongs to (its num_cached is copied back after the step)
    end: int = 0  # the slice's history is the request's tokens 0 .. end-1; it feeds num_cached .. end-1
    decode: bool = False  # a running request's one next token, scheduled before any prompt slice

    # Task L8.1: a slice: a request cut short at end, its lists shared; it samples only at the end
    @classmethod
    def of(cls, seq: Sequence, num_new: int, decode: bool = False) -> "Slice":
        end = seq.num_cached + num_new
        if not 1 <= num_new <= seq.num_tokens - seq.num_cached:  # a scheduler bug, not bad input
            raise ValueError(f"request {seq.seq_id}: a slice of {num_new} token(s) from {seq.num_cached} "
                             f"of {seq.num_tokens}")
        # The request's own lists (not copies): the slice reads the tokens and the table the scheduler reserved.
        return cls(seq.prompt_ids, seq.block_size, output_ids=seq.output_ids, blocks=seq.blocks,
                   num_cached=seq.num_cached, seq=seq, end=end, decode=decode)

    # Task L8.1: a slice: a request cut short at end, its lists shared; it samples only at the end
    @property
    def num_tokens(self) -> int:
        return self.end

    def block_table_tensor(self, n: int) -> torch.Tensor:
        return self.seq.block_table_tensor(n)  # the request's kept tensor: the slice lives one step

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    # Task L8.1: a slice: a request cut short at end, its lists shared; it samples only at the end
    @property
    def samples(self) -> bool:
        """Whether this slice reaches the request's last known token: only then do its logits mean anything
        (the next token). A slice that stops inside the prompt gets no logits row and draws no random number."""
        return self.num_tokens == self.seq.num_tokens
