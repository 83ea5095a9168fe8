"""The pieces of a Qwen3 block that no lesson touches: linear layers, RMSNorm, rotary embedding, SwiGLU MLP.

Each follows HF's arithmetic order (norms in fp32, RoPE tables in fp32) so fp32 runs agree with HF
to the last bit often, and bf16 runs differ from HF only by rounding, never by a different formula.
Within that order each piece makes as few passes over the activations as it can: results are written
into the tensor just allocated (`mul_`, `add_`) rather than into a fresh one, which rounds identically.
On the CPU each piece is one call of the C++ decode ops where they are built (shared/cpu_ops.py): the same
formulas and roundings, the sums in one fixed order, and a few-row matmul that reads each weight once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.cpu_ops import FEW_ROWS, ops_for


class Linear(nn.Linear):
    """nn.Linear without bias (no Qwen3 or Llama projection has one). A product of at most FEW_ROWS rows on the
    CPU is the C++ matmul's: a decode step's rows read each weight once. More rows (a prefill) stay with torch's
    GEMM, faster there."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T: the C++ matmul for at most FEW_ROWS rows on the CPU, torch's otherwise."""
    if x.numel() <= FEW_ROWS * weight.shape[1] and (ops := ops_for(x)) is not None:
        return ops.linear(x, weight)
    return F.linear(x, weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := ops_for(x)) is not None:  # the same arithmetic, the sum of squares in one fixed order
            return ops.rms_norm(x, self.weight, self.eps)
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
    if (ops := ops_for(x)) is not None:  # one pass: both products and their sum per element
        return ops.rope(x, cos, signed_sin)
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x) but for the sign, which sin holds
    return (x * cos).add_(swapped.mul_(signed_sin))



class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (ops := ops_for(x)) is not None:
            return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))
        # silu(gate) * up, each result written over the gate projection it came from: no extra buffers.
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))
