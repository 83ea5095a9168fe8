"""llama.cpp's way to multiply by weight blocks, emulated in torch for the quality judge (not for speed).

llama.cpp's CPU matmul quantizes the activations too: each row of x, 32 values at a time, becomes a Q8_0 block
(for Q8_0 weights) or a Q8_1 block (for Q4_1: the same, plus the block's sum for the + m term), and the dot
products run on integers: sum(q_w q_x) d_w d_x (+ m_w d_x sum(q_x)). That is exactly the fp32 product of the
dequantized weights with x rounded to 8 bits a value, which is what this module computes: x -> per 32 values
d = max|x| / 127 (kept as fp16), q = round(x / d), x' = d q, then x' W^T. Only the order of the sums differs from
llama.cpp's integer kernel (and Q8_1's stored sum, rounded to fp16, which this leaves out).

The course's kernel keeps x in fp32, so its logits are the dequantized model's exactly; this is what it would cost
to round x as llama.cpp does, measured by the same judge (scripts/l16_smoke.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lessons.l16_weight_quant.blocks import BLOCK, round_half_away
from lessons.l16_weight_quant.weights import twin


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 -> x with every 32 values rounded to an 8-bit block's (d in fp16, q = round(x / d))."""
    b = x.reshape(-1, BLOCK)
    d = b.abs().amax(1, keepdim=True) / 127
    scaled = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = round_half_away(scaled)  # C's roundf, as ggml's reference quantizer
    return (d.half().float() * q).reshape(x.shape)


class Int8ActivationLinear(nn.Module):
    """A Linear whose input is rounded to 8-bit blocks first; its weight shared."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(round_activations(x), self.weight)


def llamacpp_way(dense: nn.Module) -> nn.Module:
    """A twin of a dense model (a quantized one's dequantized_model: the same weights) whose every matmul rounds its
    input to 8-bit blocks first, as llama.cpp's does."""
    copy = twin(dense)
    for parent in list(copy.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8ActivationLinear(child))
    return copy
