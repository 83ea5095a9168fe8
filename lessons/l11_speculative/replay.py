"""The test drafter: replays the target's own greedy continuation, corrupting the positions it is told to.

Given each prompt's expected output (HF's, or the engine's without drafts), it proposes exactly what the
target will say, except at the output positions `corrupt(seq, position)` picks, where it proposes a token
that is certainly wrong. So a test decides which draft is rejected (position 0 .. k of a proposal, or
none), and a benchmark sets an acceptance rate without a model that happens to have it.
"""
from __future__ import annotations

from typing import Callable

from lessons.l4_continuous.sequence import Sequence
from lessons.l8_chunked_prefill.slice import Slice
from lessons.l11_speculative.drafter import Draft


class ReplayDrafter:
    name = "replay"

    def __init__(self, expected: dict[tuple[int, ...], list[int]], vocab_size: int,
                 corrupt: Callable[[Sequence, int], bool] = lambda seq, position: False):
        self.expected, self.vocab_size, self.corrupt = expected, vocab_size, corrupt

    def bind(self, engine) -> None:
        pass

    def propose(self, decodes: list[Slice], limits: list[int]) -> list[Draft]:
        drafts = []
        for piece, k in zip(decodes, limits):
            seq = piece.seq
            at = len(seq.output_ids)
            tokens = self.expected.get(tuple(seq.prompt_ids), [])[at:at + k]
            drafts.append(Draft([(t + 1) % self.vocab_size if self.corrupt(seq, at + j) else t
                                 for j, t in enumerate(tokens)]))
        return drafts


def every_nth_wrong(n: int) -> Callable[[Sequence, int], bool]:
    """Positions n-1, 2n-1, ... wrong: about 1 - 1/n of the drafts right (n = 1: all wrong)."""
    return lambda seq, position: position % n == n - 1


def wrong_with_rate(rate: float, seed: int = 0) -> Callable[[Sequence, int], bool]:
    """Each (request, position) wrong with probability `rate`, independently and reproducibly (a hash, not
    an RNG whose state would depend on the order drafts were asked for)."""
    import hashlib

    def corrupt(seq: Sequence, position: int) -> bool:
        digest = hashlib.blake2b(repr((seed, seq.seq_id, position)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < rate
    return corrupt
