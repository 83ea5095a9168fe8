"""What every drafter offers the engine: up to k guesses per decoding request, proposed in one call per step.

The engine calls `propose` after the scheduler has reserved each request's decode and the blocks its
drafts may need, and before the target's forward. A drafter only guesses: whatever it returns, the
verify rule keeps the output exactly what the target alone would give, so a bad drafter costs time,
never tokens. State a drafter keeps about a request lives in `seq.extra`, so it ends with the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from lessons.l8_chunked_prefill.slice import Slice


@dataclass
class Draft:
    tokens: list[int]  # d1 .. dk for positions n .. n+k-1 (k may be below the limit, or 0)
    probs: torch.Tensor | None = None  # [k, V] the distribution each was sampled from; None: one-hot (certain)


class Drafter(Protocol):
    name: str

    def bind(self, engine) -> None:
        """Called once by the engine it serves (a draft model builds its pool to match the target's)."""

    def propose(self, decodes: list[Slice], limits: list[int]) -> list[Draft]:
        """One Draft per decode slice (num_cached = n-1, end = n), at most limits[i] tokens each."""
