"""The CPU path: every decode row of the step in one attention call, over a padded page table.

The oracle loops over requests in Python on every layer; at 24 decodes x 28 layers that is 672 small
attention calls per step. Here `plan` (once per step) pads the decode requests' CSR page tables into
one rectangle [B_dec, max_pages] plus a key mask [B_dec, max_pages * S]; `run` (once per layer) gathers
those pages with one `index_select` and makes one SDPA call. Prefill rows (more than one new token)
keep the oracle's per-request causal attention: few per step, each already a large matrix product, and
one padded call for ragged prompts measured slower (the padded square wastes work on short prompts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lessons.l3_block_tensor.backends.torch_backend import history_slots
from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.attention import causal_attention


@dataclass(frozen=True)
class DecodePlan:
    rows: torch.Tensor  # [B_dec] int64: each decode request's single row in the flat stream
    pages: torch.Tensor  # [B_dec * max_pages] int64: padded page table, flattened for index_select
    key_mask: torch.Tensor  # [B_dec, 1, 1, max_pages * S] bool: True = a real key, False = padding
    max_pages: int


# Task L3.6: the batched CPU path: decode page tables padded to one rectangle + key mask, one SDPA call
def plan_decodes(meta: BatchMeta, requests: list[int]) -> DecodePlan:
    """Pad the page tables of `requests` (each feeding one token) to the longest one's page count."""
    s, device = meta.block_size, meta.positions.device
    lo, hi = meta.kv_indptr[:-1].long()[requests], meta.kv_indptr[1:].long()[requests]  # [B_dec]
    n_pages = hi - lo
    max_pages = int(n_pages.max())
    slot = torch.arange(max_pages)  # [max_pages]: page slot j of each row
    # Padding repeats each request's own first page: always a valid block id, and masked out below.
    index = torch.where(slot[None, :] < n_pages[:, None], lo[:, None] + slot[None, :], lo[:, None])
    pages = meta.kv_indices.long()[index]  # [B_dec, max_pages]
    kv_len = s * (n_pages - 1) + meta.kv_last_page_len.long()[requests]  # [B_dec], 1 .. max_pages * S
    key_mask = torch.arange(max_pages * s)[None, :] < kv_len[:, None]  # [B_dec, max_pages * S]
    return DecodePlan(
        rows=meta.qo_indptr[:-1].long()[requests].to(device),
        pages=pages.reshape(-1).to(device),
        key_mask=key_mask[:, None, None, :].to(device),  # broadcasts over heads and the one query
        max_pages=max_pages,
    )


class PageBuffers:
    """Reusable [capacity, S, Hkv, D] tensors the decode pages are gathered into, layer after layer: K and
    V in the cache's dtype and, for a half-precision cache, K and V again in fp32, which attention reads.

    A fresh gather tensor per layer means a fresh multi-MiB allocation, which the allocator hands back
    to the OS and faults in again each time: measured, that made the decode path 1.7x to 4.3x slower.
    """

    def __init__(self) -> None:
        self.store: dict[str, torch.Tensor] = {}

    def reuse(self, name: str, like: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n rows of buffer `name`, shaped like `like`; grown (never shrunk) when too small."""
        buf = self.store.get(name)
        if (buf is None or buf.shape[0] < n or buf.shape[1:] != like.shape[1:] or buf.dtype != dtype
                or buf.device != like.device):  # grow only: shrinking to each step's size would reallocate again
            buf = self.store[name] = like.new_empty((n, *like.shape[1:]), dtype=dtype)
        return buf[:n]  # a leading-dim slice: contiguous, so out= and copy_ write in place

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
               pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_cache, v_cache [N, S, Hkv, D]; pages [P] -> the pages' K and V in fp32, each [P, S, Hkv, D]."""
        n = pages.numel()
        k, v = self.reuse("k", k_cache, n, k_cache.dtype), self.reuse("v", v_cache, n, v_cache.dtype)
        # Whole pages, one contiguous copy each, into memory that is already mapped (see the class docstring).
        torch.index_select(k_cache, 0, pages, out=k)
        torch.index_select(v_cache, 0, pages, out=v)
        if k.dtype == torch.float32:
            return k, v
        return self.reuse("k32", k, n, torch.float32).copy_(k), self.reuse("v32", v, n, torch.float32).copy_(v)


# Task L3.6: the batched CPU path: decode page tables padded to one rectangle + key mask, one SDPA call
def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, p: DecodePlan) -> torch.Tensor:
    """q [B_dec, Hq, D], one token per request; k_pages, v_pages [B_dec * max_pages, S, Hkv, D], the
    padded page table's pages in order -> [B_dec, Hq, D].

    k_pages and v_pages come in fp32 whatever the cache's dtype (`PageBuffers.gather`): with one query row
    per request, CPU's SDPA measured about 4x slower on bf16 inputs than on the same inputs in fp32 (17.6
    vs 4.3 ms for 24 rows of up to 640 keys, one thread). Nothing is lost: on the tests' random bf16
    batches these decode rows sit exactly as far from the fp32 oracle as the bf16 oracle's own rows do.
    """
    b, (_, s, hkv, d) = q.shape[0], k_pages.shape
    k = k_pages.view(b, p.max_pages * s, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]: row b's keys, padded to L
    v = v_pages.view(b, p.max_pages * s, hkv, d).transpose(1, 2)
    # One query per row, so no causal mask is needed, only the key mask that hides the padding.
    out = F.scaled_dot_product_attention(
        q[:, :, None, :].float(), k, v, attn_mask=p.key_mask, enable_gqa=q.shape[1] != hkv
    )  # [B, Hq, 1, D]; .float() is free in fp32 (the same tensor back)
    return out[:, :, 0, :].to(q.dtype)


class BatchedBackend:
    name = "batched"

    def __init__(self) -> None:
        self._planned: BatchMeta | None = None
        self._decode: DecodePlan | None = None
        self._prefills: list[tuple[int, int, torch.Tensor]] = []  # (first row, end row, history slots)
        self._buffers = PageBuffers()

    # Task L3.6: the batched CPU path: decode page tables padded to one rectangle + key mask, one SDPA call
    def plan(self, meta: BatchMeta) -> None:
        q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).tolist()
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        self._decode = plan_decodes(meta, decodes) if decodes else None
        device = meta.positions.device
        self._prefills = [
            (int(meta.qo_indptr[b]), int(meta.qo_indptr[b + 1]), history_slots(meta, b).to(device))
            for b, n in enumerate(q_lens) if n > 1
        ]
        self._planned = meta

    # Task L3.6: the batched CPU path: decode page tables padded to one rectangle + key mask, one SDPA call
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        dec = self._decode
        if dec is not None:
            k_pages, v_pages = self._buffers.gather(k_cache, v_cache, dec.pages)
            if meta.decode_only:  # rows 0 .. B-1 are the requests in order: no scatter back needed
                return decode_attention(q, k_pages, v_pages, dec)
        out = torch.empty_like(q)
        if dec is not None:
            out[dec.rows] = decode_attention(q[dec.rows], k_pages, v_pages, dec)
        k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [N*S, Hkv, D] views, no copy
        for q0, q1, slots in self._prefills:
            out[q0:q1] = causal_attention(q[q0:q1], k_flat[slots], v_flat[slots])
        return out
