"""Per-request sampling: greedy, temperature, top-k, top-p, each request drawing from its own seeded RNG.

Batch invariance is the design constraint: a seeded request must sample the same tokens alone or in any
crowd. So every sampled row is processed on its own, in fp32, and consumes exactly one uniform number
from its own `torch.Generator` per generated token, whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.errors import CourseError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax); no RNG draw is made
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps everything
    seed: int | None = None  # None: the engine derives one from its own seed and the request id
    stop_token_ids: frozenset[int] = frozenset()  # stop (and keep the token) on any of these, even with ignore-eos

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise CourseError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise CourseError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise CourseError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of logits [V] -> (probabilities, token ids) of the kept support, most likely first.

    Order: temperature, then top-k, then top-p on the renormalised top-k distribution (as HF and vLLM do).
    """
    scaled = logits.float() / p.temperature
    k = scaled.numel() if p.top_k == 0 else min(p.top_k, scaled.numel())
    values, ids = torch.topk(scaled, k)  # sorted, descending
    probs = torch.softmax(values, dim=-1)
    if p.top_p < 1.0:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = int((mass_before < p.top_p).sum())  # smallest prefix whose mass reaches top_p; always >= 1
        probs, ids = probs[:keep], ids[:keep]
        probs = probs / probs.sum()
    return probs, ids


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    if p.greedy:
        return int(logits.argmax())
    probs, ids = filtered_probs(logits, p)
    u = torch.rand(1, generator=generator, device=generator.device if generator else logits.device)
    # Inverse CDF: the first token whose cumulative mass exceeds u. One draw per token, always.
    cdf = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cdf, u.to(cdf.device) * cdf[-1], right=True).clamp(max=probs.numel() - 1))
    return int(ids[idx])


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] fp32, one row per request -> N token ids."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy_rows:  # argmax is row-wise, so doing the greedy rows together changes nothing
        for i, t in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist()):
            out[i] = t
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_row(logits[i], p, generators[i])
    return out
