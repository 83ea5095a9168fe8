"""The C++ CPU backend: attention that walks the block table in place (paged_attention.cpp).

The other two CPU backends gather every request's pages into a copy before attention; this one reads K/V
from the pool where the block table says they are, as FlashInfer does on a GPU, from the same CSR tables.
It is compiled on first use (shared/kernel_build.py: a C++ compiler and ninja; about a minute) into the
course's cache folder, and loaded from there afterwards in well under a second.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.kernel_build import KernelUnavailable, build_and_load

SOURCE = Path(__file__).with_name("paged_attention.cpp")

_loaded: ModuleType | None = None
_failure: str | None = None


def load_kernel() -> ModuleType:
    """The compiled module (built the first time, in this process or an earlier one). Raises KernelUnavailable."""
    global _loaded, _failure
    if _loaded is None and _failure is None:
        try:
            _loaded = build_and_load(SOURCE)
        except KernelUnavailable as e:
            _failure = str(e)
    if _loaded is None:
        raise KernelUnavailable(_failure)
    return _loaded


class CppBackend:
    """plan() once per step cuts the step into the kernel's work items (and checks its tables); run() once per
    layer attends with them, as FlashInfer's wrappers split the work."""

    name = "cpp"

    def __init__(self) -> None:
        self.kernel = load_kernel()
        self._planned: BatchMeta | None = None
        self._work: torch.Tensor | None = None  # int64 [items, fields]: request, rows, positions, KV heads

    def plan(self, meta: BatchMeta) -> None:
        # Sized for the thread count of this step: with fewer row tiles than threads, items split KV heads.
        self._work = self.kernel.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                                      meta.block_size, torch.get_num_threads())
        self._planned = meta

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:  # a stale plan would silently attend over last step's pages
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        return self.kernel.run_planned(q, k_cache, v_cache, meta.kv_indptr, meta.kv_indices, self._work)
