"""Everything a decode step reads, allocated once at the largest captured size and refilled in place.

A captured graph remembers addresses, not values: each replay reads whatever these tensors hold at that
moment. So a step never makes new tensors for its inputs; it copies its rows into these, and pads the
rows up to the captured size with rows that attend over, and write into, the reserved dummy block only.

Shapes (Bmax = largest captured size, P = most pages one step can name, E hidden size):
  input_ids, positions, slot_mapping  [Bmax]    int64, device
  kv_indptr                            [Bmax+1]  int32, host (FlashInfer's plan() reads the page table on the host)
  kv_indices                           [P]       int32, host
  kv_last_page_len                     [Bmax]    int32, host
  hidden                               [Bmax, E] model dtype, device: the step's output (a graph's output is fixed too)
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request


class StaticDecodeBuffers:
    # Task L7.2: static buffers at the largest size; fill rows 0..n-1, pad the rest into the dummy block
    def __init__(self, max_size: int, max_pages: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        def dev(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        def host(n: int) -> torch.Tensor:
            t = torch.zeros(n, dtype=torch.int32)
            return t.pin_memory() if device.type == "cuda" else t  # pinned: plan()'s copy to the GPU is async

        self.max_size, self.max_pages = max_size, max_pages
        self.input_ids, self.positions, self.slot_mapping = dev(max_size), dev(max_size), dev(max_size)
        self.kv_indptr, self.kv_indices, self.kv_last_page_len = host(max_size + 1), host(max_pages), host(max_size)
        self.hidden = torch.zeros(max_size, hidden_size, dtype=dtype, device=device)

    # Task L7.2: static buffers at the largest size; fill rows 0..n-1, pad the rest into the dummy block
    def fill(self, requests: list[Request], size: int, dummy_block: int, block_size: int) -> None:
        """Rows 0 .. n-1: each request's one new token. Rows n .. size-1: padding, every buffer rewritten,
        so no row keeps what a bigger earlier step left there (it would write into that request's block)."""
        if not (len(requests) <= size and 1 <= size <= self.max_size):
            raise ValueError(f"{len(requests)} request(s) padded to {size} (buffers hold {self.max_size})")
        ids, positions, slots, indptr, tables, last = [], [], [], [0], [], []
        for r in requests:
            pos = r.num_cached  # a decode row feeds exactly the token at num_cached == num_tokens - 1
            if pos != r.num_tokens - 1:
                raise ValueError(f"not a decode row: feeds {r.num_tokens - pos} tokens")  # a caller bug
            n_pages = blocks_for(pos + 1, block_size)
            ids += r.token_ids(pos, pos + 1)  # that one token, not a copy of the history
            positions.append(pos)
            slots.append(r.slot(pos))
            tables.append(r.block_table_tensor(n_pages))  # int32, kept by the request (not its list converted)
            indptr.append(indptr[-1] + n_pages)
            last.append(pos + 1 - (n_pages - 1) * block_size)
        for _ in range(size - len(requests)):
            # A padded row: token 0 at position 0, written to the dummy block's first slot, and attending over
            # that one slot (a history of length 1). Its output is computed and thrown away.
            ids.append(0)
            positions.append(0)
            slots.append(dummy_block * block_size)
            tables.append(torch.tensor([dummy_block], dtype=torch.int32))
            indptr.append(indptr[-1] + 1)
            last.append(1)
        pages = torch.cat(tables)
        if len(pages) > self.max_pages:
            raise ValueError(f"a step naming {len(pages)} pages; the buffer holds {self.max_pages}")
        # copy_ into the same storage: the addresses a graph captured stay valid.
        self.input_ids[:size].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots), non_blocking=True)
        self.kv_indptr[: size + 1].copy_(torch.tensor(indptr, dtype=torch.int32))
        self.kv_indices[: len(pages)].copy_(pages)
        self.kv_last_page_len[:size].copy_(torch.tensor(last, dtype=torch.int32))
