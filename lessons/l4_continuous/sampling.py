"""Per-request sampling: greedy, temperature, top-k, top-p, each request drawing from its own seeded RNG.

Batch invariance is the design constraint: a seeded request given the same logits must sample the same
tokens alone or in any crowd. So every sampled row is processed on its own, in fp32, and consumes exactly
one uniform number from its own `torch.Generator` per generated token, whatever else is in the batch.
The filters are HF's logits warpers, in HF's order, ties included, so the kept support is HF's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shared.errors import CourseError

# torch's manual_seed takes -2**63 .. 2**64 - 1, but wraps negatives (-1 seeds like 2**64 - 1); refusing
# them keeps one seed, one stream.
SEED_LIMIT = 2**64
# Below this (the smallest normal fp32) a temperature would round to 0 or a subnormal when the row is
# divided in fp32; dividing by it instead already gives every token below the top probability 0.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def check_seed(seed: object, what: str = "seed") -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise CourseError(f"{what} must be an integer in [0, 2**64 - 1], got {seed!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax); no RNG draw is made
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps everything
    seed: int | None = None  # None: the engine derives one from its own seed and the request id
    stop_token_ids: frozenset[int] = frozenset()  # stop (and keep the token) on any of these, even with ignore-eos

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise CourseError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise CourseError(f"top-k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise CourseError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Task L4.5: HF's warpers on one row [V]: temperature (max-shifted), top-k with ties, top-p -> (probs, ids) kept
def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of logits [V] -> (probabilities, token ids) of the kept support, in token-id order.

    As HF's warpers: temperature, then top-k (every token tied with the k-th stays), then top-p on what
    top-k left. The support is exactly the tokens left with nonzero probability.
    """
    row = logits.float()
    # Softmax ignores a shift. Shifting first puts the top token at exactly 0, so a tiny temperature sends
    # the rest towards -inf (probability 0) instead of overflowing to inf and giving inf - inf = NaN.
    scaled = (row - row.max()) / max(p.temperature, MIN_TEMPERATURE)
    if p.top_k:
        kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if p.top_p < 1:
        ascending, order = torch.sort(scaled, stable=True)
        # HF's rule: drop the least likely tokens while their mass stays <= 1 - top_p; the top one always stays
        drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1 - p.top_p
        drop[-1] = False
        scaled = scaled.index_fill(0, order[drop], -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    ids = probs.nonzero().flatten()
    return probs[ids], ids


# Task L4.6: greedy: argmax; sampled: one uniform per token from its own generator, inverse CDF in id order
def pick(probs: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse CDF: the first kept token whose cumulative mass exceeds u (a uniform in [0, 1)).

    The CDF runs in token-id order, as torch.multinomial's CPU kernel does: a tiny change in the logits
    then moves each boundary a tiny amount. Sorting by probability instead would let two nearly tied
    tokens swap places and move a boundary by a whole token's mass.
    """
    cdf = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cdf, u.to(cdf.device) * cdf[-1], right=True)
    return int(ids[int(idx.clamp(max=ids.numel() - 1))])


# Task L4.6: greedy: argmax; sampled: one uniform per token from its own generator, inverse CDF in id order
def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    if p.greedy:
        return int(logits.argmax())
    if generator is None:  # the global RNG would tie this request's draws to everything else that uses it
        raise ValueError("a sampled row needs its own torch.Generator")
    probs, ids = filtered_probs(logits, p)
    u = torch.rand(1, generator=generator, device=generator.device)  # one draw per token, always
    return pick(probs, ids, u)


# Task L4.6: greedy: argmax; sampled: one uniform per token from its own generator, inverse CDF in id order
def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] fp32, one row per request -> N token ids."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == len(params):  # all greedy (the common case): no copy of the [N, V] rows
        return logits.argmax(dim=-1).tolist()
    out = [0] * len(params)
    if greedy_rows:  # argmax is row-wise, so doing the greedy rows together changes nothing
        for i, t in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist()):
            out[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_row(logits[i], p, generators[i])
    return out
