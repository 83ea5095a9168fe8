"""A verify slice: a decode's one token with the drafts behind it, checked by the target in one forward.

L8's slice already feeds several tokens of one request with bottom-right causal alignment (a prompt slice).
A verify slice is a decode slice that runs past the request's last known token: it feeds token n-1 (the
last committed one, not yet in the pool) and drafts d1 .. dk at positions n .. n+k-1, so its history is
n + k long. The drafts live only here, for one step: the request's own token lists never hold a guess.
Every row gets logits (L8's runner scores every row of a decode slice): row j is the target's choice for
position n+j, checked against d(j+1); the last row gives the bonus token when every draft was right.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lessons.l8_chunked_prefill.slice import Slice


@dataclass(eq=False)
class VerifySlice(Slice):
    drafts: list[int] = field(default_factory=list)  # d1 .. dk
    draft_probs: torch.Tensor | None = None  # [k, V] what they were sampled from; None: proposed with certainty

    # Task L11.4: the verify slice: the decode's token at n-1, then drafts d1..dk at positions n..n+k-1 (end = n + k)
    @classmethod
    def of_decode(cls, piece: Slice, drafts: list[int], draft_probs: torch.Tensor | None = None) -> "VerifySlice":
        """The decode slice `piece` (num_cached = n-1, end = n) extended by `drafts`."""
        seq = piece.seq
        return cls(seq.prompt_ids, seq.block_size, output_ids=seq.output_ids, blocks=seq.blocks,
                   num_cached=piece.num_cached, seq=seq, end=seq.num_tokens + len(drafts), decode=True,
                   drafts=list(drafts), draft_probs=draft_probs)

    # Task L11.4: the verify slice: the decode's token at n-1, then drafts d1..dk at positions n..n+k-1 (end = n + k)
    def token_ids(self, start: int, end: int) -> list[int]:
        """Committed tokens from the request's lists, then the drafts (positions n ..)."""
        n = self.seq.num_tokens
        return super().token_ids(start, min(end, n)) + self.drafts[max(start - n, 0):max(end - n, 0)]

    @property
    def samples(self) -> bool:
        return True  # its rows are the target's next tokens, whatever the drafts turn out to be
