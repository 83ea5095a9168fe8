"""One step's metadata for a batch of requests: CSR page tables for the kernel, slots for the writes.

Built once per step on the host from Python ints, turned into tensors in one place, shared by every
layer. The page tables come from each request as a tensor (`Request.block_table_tensor`), so a request
that keeps its table as a tensor between steps (L4's Sequence) costs a step its new entries, not its
whole history. Request b feeds its tokens num_cached .. num_tokens-1; they sit at rows
qo_indptr[b] .. qo_indptr[b+1]-1 of the flat stream, and after the step its KV history is num_tokens
long, held in pages kv_indices[kv_indptr[b] : kv_indptr[b+1]].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request


@dataclass(frozen=True)
class BatchMeta:
    block_size: int  # S, FlashInfer's page_size
    qo_indptr: torch.Tensor  # [B+1] int32 cpu: request b's new tokens are rows qo_indptr[b] .. qo_indptr[b+1]-1
    kv_indptr: torch.Tensor  # [B+1] int32 cpu: request b's pages are kv_indices[kv_indptr[b] : kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [P] int32 cpu: physical block ids, in position order per request
    kv_last_page_len: torch.Tensor  # [B] int32 cpu: tokens in each request's last page, 1 .. S
    positions: torch.Tensor  # [T] int64 device: absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64 device: flat pool slot each new token's K/V is written to
    last_rows: torch.Tensor  # [B] int64 device: row of each request's last new token (the one we sample from)
    decode_only: bool  # every request feeds exactly one token: the decode kernel can run the step

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    # Task L3.2: one step's CSR page tables (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), positions, slots
    @classmethod
    def build(cls, requests: list[Request], block_size: int, device: torch.device) -> "BatchMeta":
        if not requests:
            raise ValueError("a step needs at least one request")
        qo, kv, pages, last, positions, slots = [0], [0], [], [], [], []
        for r in requests:
            start, end = r.num_cached, r.num_tokens
            n_pages = blocks_for(end, block_size)
            if start >= end or len(r.blocks) < n_pages:  # bookkeeping bugs, not bad input
                raise ValueError(f"request feeds {start}..{end - 1} with {len(r.blocks)} block(s) reserved")
            # Only the pages the history fills: blocks reserved ahead of time are not the kernel's business.
            pages.append(r.block_table_tensor(n_pages))
            qo.append(qo[-1] + end - start)
            kv.append(kv[-1] + n_pages)
            last.append(end - (n_pages - 1) * block_size)  # 1 .. S, never 0: a full page counts S
            positions += range(start, end)
            slots += r.slots(start, end)

        def pinned(t: torch.Tensor) -> torch.Tensor:
            # int32 on the host: FlashInfer's plan() reads these on the CPU (device tensors would force a
            # sync); pinned on CUDA machines so its copy to the GPU is asynchronous.
            return t.pin_memory() if device.type == "cuda" else t

        def host(xs: list[int]) -> torch.Tensor:
            return pinned(torch.tensor(xs, dtype=torch.int32))

        def dev(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(
            block_size=block_size,
            qo_indptr=host(qo),
            kv_indptr=host(kv),
            kv_indices=pinned(torch.cat(pages)),
            kv_last_page_len=host(last),
            positions=dev(positions),
            slot_mapping=dev(slots),
            last_rows=dev([q - 1 for q in qo[1:]]),
            decode_only=qo[-1] == len(requests),
        )
