"""The parity rule: exact greedy token IDs, with half-precision ties told apart from real failures."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

from shared.hf_reference import HfOutput

# A divergence in half precision counts as a numerical tie in one of two ways:
# - our token is HF's runner-up there and HF's top-2 logit margin is at most TIE_ULPS units of rounding of
#   the dtype at the size of the top logit. Logits come out of a half-precision matmul, so they are
#   quantised: a bf16 logit near 48 moves in steps of 0.25, and a 0.25 margin is one rounding step, not
#   evidence of a bug;
# - or HF itself, run in fp32 on the same tokens, picks our token there: HF's half-precision run moved
#   its own argmax (it can demote the fp32 winner below second place), and we kept the precise answer.
# Any other token is a bug however small the margin, and fp32 gets no exceptions.
TIE_ULPS = 2


def tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    if dtype == torch.float32:
        return 0.0
    return TIE_ULPS * torch.finfo(dtype).eps * max(1.0, abs(top_logit))


# Given the tokens before the divergence (prompt and generated), HF's fp32 greedy choice for the next one.
Arbiter = Callable[[list[int]], int]


@dataclass(frozen=True)
class Verdict:
    status: str  # "match", "tie" or "mismatch"
    position: int | None = None  # first position where the token lists differ
    ours: int | None = None  # None: our list ended there
    theirs: int | None = None  # None: HF's list ended there
    margin: float | None = None  # HF's top-1 minus top-2 logit at that position
    tolerance: float | None = None  # the largest margin that still counts as a tie there
    runner_up: int | None = None  # HF's second choice there: a rounding tie must have picked exactly this
    fp32_pick: int | None = None  # HF's fp32 choice there, when the arbiter was asked

    @property
    def ok(self) -> bool:
        return self.status != "mismatch"

    def to_json(self) -> dict:
        return asdict(self)


def compare(ours: list[int], hf: HfOutput, dtype: torch.dtype, prompt: list[int] | None = None,
            arbiter: Arbiter | None = None) -> Verdict:
    """Judge only the first divergence: after a tie the two continuations are different texts.

    A length difference is never a tie by itself. Ours ending early (or running on) with every token equal
    means the stop rule differs; a tie that picked EOS shows up as a divergence at that token instead.
    The arbiter (with the prompt) is asked only in half precision, only when the rounding rule says no.
    """
    if ours == hf.tokens:
        return Verdict("match")
    pos = next((i for i, (a, b) in enumerate(zip(ours, hf.tokens)) if a != b), min(len(ours), len(hf.tokens)))
    mine = ours[pos] if pos < len(ours) else None
    theirs = hf.tokens[pos] if pos < len(hf.tokens) else None
    if mine is None or theirs is None:
        return Verdict("mismatch", pos, mine, theirs)
    margin, tol, second = hf.margins[pos], tie_tolerance(dtype, hf.top_logits[pos]), hf.runner_ups[pos]
    if mine == second and margin <= tol:
        return Verdict("tie", pos, mine, theirs, margin, tol, second)
    if dtype == torch.float32 or arbiter is None or prompt is None:
        return Verdict("mismatch", pos, mine, theirs, margin, tol, second)
    pick = arbiter(prompt + ours[:pos])  # ours[:pos] == HF's tokens[:pos]: the divergence is the first
    return Verdict("tie" if pick == mine else "mismatch", pos, mine, theirs, margin, tol, second, pick)
