"""The CPU path and the oracle: walk the same CSR page tables the kernel gets, in plain torch.

pages -> slots -> K/V, then the reference causal attention per request (bottom-right aligned). Slow
(a Python loop over requests per layer) and obviously right, which is what an oracle must be.
"""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.attention import causal_attention


# Task L3.3: the oracle: expand each request's page table to flat slots, attend causally per request
def history_slots(meta: BatchMeta, b: int) -> torch.Tensor:
    """Flat slots of request b's whole KV history, in position order: the page table, expanded."""
    s = meta.block_size
    lo, hi = int(meta.kv_indptr[b]), int(meta.kv_indptr[b + 1])
    pages = meta.kv_indices[lo:hi].long()
    kv_len = s * (hi - lo - 1) + int(meta.kv_last_page_len[b])
    return (pages[:, None] * s + torch.arange(s)).reshape(-1)[:kv_len]


class TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        self._planned: BatchMeta | None = None
        self._per_request: list[tuple[int, int, torch.Tensor]] = []

    # Task L3.3: the oracle: expand each request's page table to flat slots, attend causally per request
    def plan(self, meta: BatchMeta) -> None:
        device = meta.positions.device
        self._per_request = [
            (int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1]), history_slots(meta, b).to(device))
            for b in range(meta.batch_size)
        ]
        self._planned = meta

    # Task L3.3: the oracle: expand each request's page table to flat slots, attend causally per request
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [N*S, Hkv, D] views, no copy
        outs = [causal_attention(q[q0:q1], k_flat[slots], v_flat[slots]) for q0, q1, slots in self._per_request]
        return torch.cat(outs)
