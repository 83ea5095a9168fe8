"""The batch-invariant model: the same Qwen3 and the same weights, with every matmul and RMSNorm computed by L14's
C++ ops (shared/cpu_ops.cpp), whose result for a row does not depend on the other rows.

The rest of a step is invariant already, and the tests hold it to that: the embedding and RoPE are per-row
lookups and elementwise arithmetic; L3's attention kernel computes every (query row, head) lane with the same
code over the same pages in the same order, whether the row is a decode, a verify row or a prompt row, alone or
in a batch (its plan splits work by KV head, never a row's keys); L4's sampler takes each row on its own."""
from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from lessons.l14_batch_invariant.ops import load_ops
from shared.errors import CourseError
from shared.layers import RMSNorm
from shared.model import Qwen3ForCausalLM

INVARIANT_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ ops compute in


class InvariantLinear(nn.Module):
    """nn.Linear without bias, its weight shared: x [..., K] -> x W^T [..., N], one fixed order per output."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:  # no Qwen3 or Llama projection has one; a model that did would lose it silently
            raise CourseError("the batch-invariant matmul takes Linears without bias")
        self.weight = linear.weight
        self.ops = load_ops()

    # Task L14.2: the Linear and RMSNorm forwards, through the invariant ops (x [..., K] or [..., E])
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight)


class InvariantRMSNorm(nn.Module):
    """shared.layers.RMSNorm's arithmetic (HF's) with one fixed order for each row's sum of squares."""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        self.ops = load_ops()

    # Task L14.2: the Linear and RMSNorm forwards, through the invariant ops (x [..., K] or [..., E])
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


# Task L14.3: a twin of the model whose Linears and RMSNorms are the invariant ones, sharing every tensor
def invariant_model(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """A copy of the module tree holding the same parameter and buffer tensors (no weight is copied), with each
    nn.Linear and RMSNorm replaced. The model passed in is untouched: an engine in default mode can share it."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    for parent in list(twin.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, InvariantLinear(child))
            elif isinstance(child, RMSNorm):
                setattr(parent, name, InvariantRMSNorm(child))
    return twin
