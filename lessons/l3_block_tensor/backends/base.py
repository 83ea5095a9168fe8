"""The interface every attention backend keeps: plan once per step, run once per layer."""
from __future__ import annotations

from typing import Protocol

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: BatchMeta) -> None:
        """Turn the step's page tables into whatever `run` needs. Same for every layer, so done once."""

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """q [T, Hq, D]; k_cache, v_cache one layer's pages [N, S, Hkv, D], this step's K/V already
        written. Returns [T, Hq, D]: each request's new tokens attend causally over its own pages."""
