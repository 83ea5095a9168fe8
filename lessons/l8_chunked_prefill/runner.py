"""L7's graph runner, fed slices: logits only for the slices that sample, graphs only for pure decode steps.

Two things change. A step's slices that stop inside a prompt are computed (their K/V is written) but get
no logits row: with a 151,936-word vocabulary the LM head is the largest matmul a decode row pays for,
and its output would be thrown away. And a step may replay a captured graph only when every row is a
decode that samples; a step holding any prompt slice, even a one-token one, runs eagerly, so the graphs
keep the shapes (and the meaning) they were captured with.

The rule reads only the slice's own numbers, so every rank of L10 applies it the same way. The block between
`# >>> L11` and `# <<< L11` is L11's (a decode slice that feeds drafts gets a row for each); reading L8, skip it.
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l7_cuda_graphs.graph_runner import GraphRunner
from lessons.l8_chunked_prefill.slice import Slice


class ChunkedRunner(GraphRunner):
    # Task L8.5: one forward over slices; logits for the sampling ones; graphs for decode-only steps
    def graph_size(self, requests: list[Slice]) -> int | None:
        if not all(s.decode and s.samples for s in requests):
            return None
        return super().graph_size(requests)

    # Task L8.5: one forward over slices; logits for the sampling ones; graphs for decode-only steps
    def forward(self, slices: list[Slice]) -> torch.Tensor:
        """Compute every slice; fp32 logits [rows scored (scored_rows), vocab], in batch order."""
        if self.graph_size(slices) is not None:
            return super().forward(slices)  # decodes only: every row samples
        self.eager_steps += 1
        meta = BatchMeta.build(slices, self.block_size, self.device)
        ids = [t for s in slices for t in s.token_ids(s.num_cached, s.num_tokens)]
        self.backend.plan(meta)
        hidden = self.model(torch.tensor(ids, device=self.device), meta.positions, self, meta)
        rows = scored_rows(slices, meta)
        for s in slices:
            s.num_cached = s.num_tokens
        return self.model.logits(hidden[rows])  # the vocabulary projection: sampling rows only


# Task L8.5: one forward over slices; logits for the sampling ones; graphs for decode-only steps
def scored_rows(slices: list[Request], meta: BatchMeta) -> torch.Tensor:
    """The rows of the flat stream that get logits, in batch order: each sampling slice's last row."""
    starts, ends = meta.qo_indptr[:-1].tolist(), meta.qo_indptr[1:].tolist()
    rows = []
    for s, a, b in zip(slices, starts, ends):
        if not s.samples:
            continue
        # >>> L11: a verify slice feeds a decode's token plus its drafts, and each row is a guess to check
        if s.decode:
            rows.extend(range(a, b - 1))
        # <<< L11
        rows.append(b - 1)
    return torch.tensor(rows, dtype=torch.int64, device=meta.last_rows.device)
