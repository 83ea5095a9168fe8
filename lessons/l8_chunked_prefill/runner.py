"""L7's graph runner, fed slices: logits only for the slices that sample, graphs only for pure decode steps.

Two things change. A step's slices that stop inside a prompt are computed (their K/V is written) but get
no logits row: with a 151,936-word vocabulary the LM head is the largest matmul a decode row pays for,
and its output would be thrown away. And a step may replay a captured graph only when every row is a
decode that samples; a step holding any prompt slice, even a one-token one, runs eagerly, so the graphs
keep the shapes (and the meaning) they were captured with.
"""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l7_cuda_graphs.graph_runner import GraphRunner
from lessons.l8_chunked_prefill.slice import Slice


class ChunkedRunner(GraphRunner):
    def graph_size(self, requests: list[Slice]) -> int | None:
        if not all(s.decode and s.samples for s in requests):
            return None
        return super().graph_size(requests)

    def forward(self, slices: list[Slice]) -> torch.Tensor:
        """Compute every slice; fp32 logits [number of slices that sample, vocab], in batch order."""
        if self.graph_size(slices) is not None:
            return super().forward(slices)  # decodes only: every row samples
        self.eager_steps += 1
        meta = BatchMeta.build(slices, self.block_size, self.device)
        ids = [t for s in slices for t in s.token_ids(s.num_cached, s.num_tokens)]
        self.backend.plan(meta)
        hidden = self.model(torch.tensor(ids, device=self.device), meta.positions, self, meta)
        for s in slices:
            s.num_cached = s.num_tokens
        sampling = [i for i, s in enumerate(slices) if s.samples]
        return self.model.logits(hidden[meta.last_rows[sampling]])  # the vocabulary projection: sampling rows only
