"""What one forward step tells the attention layers, built once per step and shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.request import Request


@dataclass(frozen=True)
class ForwardMeta:
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64: pool slot each new token's K/V is written to
    kv_indices: torch.Tensor  # [L] int64: slots of the whole history (new tokens included), position order
    is_prefill: bool

    # Task L2.4: one step's positions [T], slot_mapping [T] and kv_indices [L]
    @classmethod
    def for_step(cls, req: Request, device: torch.device) -> "ForwardMeta":
        """The step that feeds req's tokens num_cached .. num_tokens-1. Blocks must already be reserved."""
        start, end = req.num_cached, req.num_tokens
        return cls(
            positions=torch.arange(start, end, device=device),
            slot_mapping=torch.tensor(req.slots(start, end), device=device),
            kv_indices=torch.tensor(req.slots(0, end), device=device),
            is_prefill=start == 0,
        )
