"""A request's sampling parameters plus the grammar its output must match.

The grammar rides in the sampling parameters because everything that carries those already carries it to
where it is needed: L6's siblings (n > 1) share their parent's, L5's recompute keeps them, the server builds
them from the request body. Each output's *state* in the grammar is not shared: it is a matcher of its own,
kept in `seq.extra["matcher"]` (engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from lessons.l4_continuous.sampling import SamplingParams
from lessons.l13_structured.grammar import Grammar


@dataclass(frozen=True)
class ConstrainedSampling(SamplingParams):
    grammar: Grammar | None = None  # None: an unconstrained request, exactly L4's


def grammar_of(sampling: SamplingParams) -> Grammar | None:
    return getattr(sampling, "grammar", None)
