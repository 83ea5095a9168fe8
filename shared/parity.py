"""The parity rule: exact greedy token IDs, with half-precision ties told apart from real failures."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shared.hf_reference import HfOutput

# A divergence in half precision counts as a numerical tie when HF's top-2 logit margin at that position
# is below this. Set from the formats' precision (bf16 keeps 8 significant bits, fp16 11) for logits
# of magnitude ~30; fp32 gets no exceptions.
TIE_TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 0.25, torch.float16: 0.04}


@dataclass(frozen=True)
class Verdict:
    status: str  # "match", "tie" or "mismatch"
    position: int | None = None  # first position where the token lists differ
    ours: int | None = None  # None: our list ended there
    theirs: int | None = None  # None: HF's list ended there
    margin: float | None = None  # HF's top-1 minus top-2 logit at that position

    @property
    def ok(self) -> bool:
        return self.status != "mismatch"

    def to_json(self) -> dict:
        return asdict(self)


def compare(ours: list[int], hf: HfOutput, dtype: torch.dtype) -> Verdict:
    if ours == hf.tokens:
        return Verdict("match")
    pos = next((i for i, (a, b) in enumerate(zip(ours, hf.tokens)) if a != b), min(len(ours), len(hf.tokens)))
    mine = ours[pos] if pos < len(ours) else None
    theirs = hf.tokens[pos] if pos < len(hf.tokens) else None
    margin = hf.margins[pos] if pos < len(hf.margins) else None
    tie = margin is not None and margin < TIE_TOLERANCE[dtype]
    return Verdict("tie" if tie else "mismatch", pos, mine, theirs, margin)
