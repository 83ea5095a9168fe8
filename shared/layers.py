"""The pieces of a Qwen3 block that no lesson touches: RMSNorm, rotary embedding, SwiGLU MLP.

Each follows HF's arithmetic order (norms in fp32, RoPE tables in fp32) so fp32 runs agree with HF
to the last bit often, and bf16 runs differ from HF only by rounding, never by a different formula.
Within that order each piece makes as few passes over the activations as it can: results are written
into the tensor just allocated (`mul_`, `add_`) rather than into a fresh one, which rounds identically.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's Qwen3RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), the same roundings in place.
        x32 = x.float()  # x itself in fp32: never written to below
        scale = x32.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (x32 * scale).to(x.dtype).mul_(self.weight)


class RotaryEmbedding(nn.Module):
    """NeoX-style RoPE: rotate the two halves of each head by angle position * theta^(-2i/D).

    `tables` computes a step's cos and sin once (they depend on positions only); every layer's call then
    rotates its q and k with them."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (absolute, int64) -> cos, signed sin [T, 1, D] in `dtype`, computed in fp32 as HF does.

        sin's first half is stored negated: HF's rotate_half(x) * sin is cat(-x2, x1) * sin, and
        (-x2) * sin equals x2 * (-sin) exactly, so rotating needs no negation pass and rounds as HF's."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        sin[:, : sin.shape[-1] // 2].neg_()
        return cos[:, None, :], sin[:, None, :]

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> x * cos + rotate_half(x) * sin for each (HF's formula), four passes each."""
        return _rotate(q, *tables), _rotate(k, *tables)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x) but for the sign, which sin holds
    return (x * cos).add_(swapped.mul_(signed_sin))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up, each result written over the gate projection it came from: no extra buffers.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))
