"""A contiguous KV cache: per layer, K and V of shape [max_seq_len, Hkv, D], token p at row p."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention import causal_attention
from shared.config import Qwen3Config


@dataclass(frozen=True)
class ContiguousMeta:
    start: int  # position of the step's first token; rows 0 .. start-1 already hold the history


class ContiguousKvCache:
    # Task L1.1: reserve K and V, [max_seq_len, Hkv, D] per layer, zero-filled
    def __init__(self, cfg: Qwen3Config, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        shape = (max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]

    # Task L1.2: write the step's K/V rows at meta.start, attend over rows 0 .. end
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ContiguousMeta) -> torch.Tensor:
        end = meta.start + q.shape[0]
        self.k[layer][meta.start:end] = k
        self.v[layer][meta.start:end] = v
        return causal_attention(q, self.k[layer][:end], self.v[layer][:end])
