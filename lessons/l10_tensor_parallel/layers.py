"""The four kinds of split layer. Only two talk to the other ranks: the row-parallel linear and the
vocabulary-parallel embedding each end in an all-reduce; the LM head gathers its logits to rank 0."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lessons.l10_tensor_parallel.group import TpGroup
from shared.layers import Linear, linear


class ColumnParallelLinear(Linear):
    """The rows of a weight that make this rank's slice of the output (its heads, its share of the MLP).
    Nothing to send: what follows (attention per head, SwiGLU per element) needs only this slice."""

    def __init__(self, in_features: int, local_out_features: int):
        super().__init__(in_features, local_out_features)


class RowParallelLinear(Linear):
    """The columns of a weight whose input is split across the ranks (the heads into o_proj, the MLP's width
    into down_proj). Each rank's product is a partial sum of the whole output; the all-reduce adds them."""

    def __init__(self, local_in_features: int, out_features: int, group: TpGroup):
        super().__init__(local_in_features, out_features)
        self.group = group

    # Task L10.3: split layers: row-parallel and embedding all-reduce, the LM head gathers
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table. A token id outside them gives a zero row here, and exactly
    one rank gives its real row, so the all-reduce's sum is the embedding (exactly: the rest are zeros)."""

    def __init__(self, vocab: range, hidden_size: int, group: TpGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.start, self.stop, self.group = vocab.start, vocab.stop, group

    # Task L10.3: split layers: row-parallel and embedding all-reduce, the LM head gathers
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        # Unmasked, an id past this shard would index past its rows (an error) or, shifted, a wrong row.
        rows = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill(~mine[:, None], 0))


class VocabParallelLMHead(nn.Module):
    """This rank's rows of the LM head: the logits of its share of the vocabulary, gathered to rank 0, which
    samples. Each logit is a whole dot product on one rank, so the gathered logits are exact."""

    def __init__(self, hidden_size: int, vocab: range, vocab_size: int, group: TpGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(vocab), hidden_size))
        self.vocab_size, self.group = vocab_size, group

    # Task L10.3: split layers: row-parallel and embedding all-reduce, the LM head gathers
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, E] -> rank 0: fp32 logits [N, vocab]; other ranks: None."""
        if hidden.shape[0] == 0:  # every rank knows this step samples nothing: no gather to make
            return torch.empty(0, self.vocab_size, device=hidden.device)
        return self.group.gather_last_dim(linear(hidden, self.weight).float())
