"""The parity rule: exact greedy token IDs, with half-precision ties told apart from real failures."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Protocol

import torch

from shared.generation import StopRule
from shared.hf_reference import HfOutput

# A divergence in half precision counts as a numerical tie in one of two ways:
# - in HF's own run, HF's logit for our token is within TIE_ULPS units of rounding of HF's top logit (the
#   dtype's rounding at the size of that logit). Logits come out of a half-precision matmul, so they are
#   quantised: a bf16 logit near 48 moves in steps of 0.25, and a token 0.25 below the top is one rounding
#   step from winning, not evidence of a bug. Most often it is HF's runner-up; where several tokens share
#   the top or the second logit exactly (common in bf16), it can be any of them;
# - or HF itself, run in fp32 on the same tokens, picks our token there: HF's half-precision run moved
#   its own argmax (it can demote the fp32 winner below second place), and we kept the precise answer.
# Any other token is a bug however small the margin, and fp32 gets no exceptions.
TIE_ULPS = 2


def tie_tolerance(dtype: torch.dtype, top_logit: float) -> float:
    if dtype == torch.float32:
        return 0.0
    return TIE_ULPS * torch.finfo(dtype).eps * max(1.0, abs(top_logit))


class Oracle(Protocol):
    """HF asked about tokens it did not generate itself (`HfReference` is one; the tests use fakes)."""

    def score(self, ids: list[int], start: int) -> HfOutput:
        """HF teacher-forced over `ids` in the run's dtype: its choice after ids[:k] for k = start..len(ids)."""

    def fp32_argmax(self, ids: list[int]) -> int:
        """HF's greedy choice after `ids`, in fp32 from the checkpoint: the arbiter."""


@dataclass(frozen=True)
class Verdict:
    status: str  # "match", "tie" or "mismatch"
    position: int | None = None  # a mismatch: where; a tie: the first divergence
    ours: int | None = None  # None: our list ended there
    theirs: int | None = None  # HF's pick there (on our tokens, after a tie); None: HF, or our stop rule, ended it
    margin: float | None = None  # HF's top-1 minus top-2 logit at that position
    tolerance: float | None = None  # the largest margin that still counts as a tie there
    runner_up: int | None = None  # HF's second choice there
    fp32_pick: int | None = None  # HF's fp32 choice there, when the arbiter was asked
    gap: float | None = None  # HF's top logit minus its logit for our token (None: ours is not among HF's best)
    judged: int = 0  # how many of our tokens were judged, from position 0: all of them unless a mismatch stopped it
    ties: tuple[int, ...] = ()  # every position judged a tie (ours not HF's pick, but within the rule)

    @property
    def ok(self) -> bool:
        return self.status != "mismatch"

    def to_json(self) -> dict:
        return asdict(self)


def compare(ours: list[int], hf: HfOutput, dtype: torch.dtype, stop: StopRule, prompt: list[int] | None = None,
            oracle: Oracle | None = None) -> Verdict:
    """Judge every one of our tokens: is it HF's greedy choice, or a tie, given the tokens before it?

    Up to the first divergence both runs have the same context, so HF's own run (`hf`) says what HF picks.
    After a tie the two continuations are different texts, and HF's run says nothing about ours: so the
    oracle scores the prompt plus all our tokens in one teacher-forced forward, and every later position
    is judged by the same rule on our own context. fp32 has no ties, so there nothing is ever scored.

    Lengths: ours must end exactly where the stop rule ends it (after an EOS that was itself judged
    acceptable, unless EOS is ignored, or at max_new_tokens). With every token equal, a different length
    means the stop rule differs: a mismatch, never a tie. Running on where HF would pick EOS is a
    divergence like any other (allowed only as a tie), as is stopping at an EOS within rounding of HF's top.
    The arbiter (fp32) is asked only in half precision, only when the rounding rule says no. Without an
    oracle, only the rounding rule applies, and a tie with tokens after it cannot be judged: ValueError.
    """
    if ours == hf.tokens:
        return Verdict("match", judged=len(ours))
    pos = next((i for i, (a, b) in enumerate(zip(ours, hf.tokens)) if a != b), min(len(ours), len(hf.tokens)))
    mine = ours[pos] if pos < len(ours) else None
    theirs = hf.tokens[pos] if pos < len(hf.tokens) else None
    if mine is None or theirs is None:
        return Verdict("mismatch", pos, mine, theirs, judged=min(pos + 1, len(ours)))
    first = _judge(pos, mine, hf, pos, dtype, _arbiter(oracle, prompt, ours, pos))
    if not first.ok:
        return replace(first, judged=pos + 1)

    ties, scored = [pos], None
    for i in range(pos + 1, len(ours) + 1):
        done = stop.is_done(ours[:i])  # our own stop rule: EOS (unless ignored) or max_new_tokens reached
        if i == len(ours) and done:
            break  # ours ended where the stop rule ends it
        if done:  # ours ran on past its own EOS or past max_new_tokens
            return Verdict("mismatch", i, ours[i], None, judged=i + 1, ties=tuple(ties))
        if scored is None:
            if oracle is None or prompt is None:
                raise ValueError(f"a tie at position {pos} leaves our later tokens to judge: pass the prompt and an oracle")
            # One forward; entry j: HF after our first pos+1+j tokens. Never past max_new_tokens: an overlong
            # output fails there, and must not run HF past the model's positions.
            scored = oracle.score(prompt + ours[:stop.max_new_tokens], len(prompt) + pos + 1)
        j = i - pos - 1
        if i == len(ours):  # ours stopped with no EOS and before max_new_tokens: nothing explains it
            return Verdict("mismatch", i, None, scored.tokens[j], judged=i, ties=tuple(ties))
        if ours[i] == scored.tokens[j]:
            continue
        v = _judge(i, ours[i], scored, j, dtype, _arbiter(oracle, prompt, ours, i))
        if not v.ok:
            return replace(v, judged=i + 1, ties=tuple(ties))
        ties.append(i)
    return replace(first, judged=len(ours), ties=tuple(ties))


def _judge(position: int, mine: int, hf: HfOutput, j: int, dtype: torch.dtype, arbiter) -> Verdict:
    """Our token `mine` where HF (entry j of `hf`) picked another: a tie by either rule, or a mismatch."""
    theirs, margin, second, top = hf.tokens[j], hf.margins[j], hf.runner_ups[j], hf.top_logits[j]
    tol = tie_tolerance(dtype, top)
    near = hf.near[j] if j < len(hf.near) else {second: top - margin}  # an HfOutput built without them
    gap = top - near[mine] if mine in near else None
    facts = dict(position=position, ours=mine, theirs=theirs, margin=margin, tolerance=tol, runner_up=second, gap=gap)
    if dtype != torch.float32 and gap is not None and gap <= tol:  # fp32: even an exact tie of logits is a bug
        return Verdict("tie", **facts)
    if dtype == torch.float32 or arbiter is None:
        return Verdict("mismatch", **facts)
    pick = arbiter()
    return Verdict("tie" if pick == mine else "mismatch", fp32_pick=pick, **facts)


def _arbiter(oracle: Oracle | None, prompt: list[int] | None, ours: list[int], i: int):
    """Asks HF in fp32 for its choice after the prompt and our first i tokens; None when there is no oracle."""
    if oracle is None or prompt is None:
        return None
    return lambda: oracle.fp32_argmax(prompt + ours[:i])
