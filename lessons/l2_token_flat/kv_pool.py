"""The token-flat pool: per layer, K and V of shape [num_slots, Hkv, D]; writes by slot, reads by gather."""
from __future__ import annotations

import torch

from lessons.l2_token_flat.forward_meta import ForwardMeta
from shared.attention import causal_attention
from shared.config import Qwen3Config


class KvPool:
    def __init__(self, cfg: Qwen3Config, num_slots: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    # Task L2.5: scatter the step's K/V [T, Hkv, D] by slot, gather the history, attend
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        # The three lines that replace L1's slicing: scatter the new K/V, gather the whole history.
        self.k[layer][meta.slot_mapping] = k
        self.v[layer][meta.slot_mapping] = v
        return causal_attention(q, self.k[layer][meta.kv_indices], self.v[layer][meta.kv_indices])
