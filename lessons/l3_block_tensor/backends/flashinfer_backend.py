"""The CUDA path: FlashInfer's paged kernels read the pool's pages through the CSR page table.

Never run in this project (no GPU was available); written against the checked API facts in the lesson doc and guarded
by tests/test_l3_flashinfer_contract.py. FlashInfer is imported here only, at construction.
"""
from __future__ import annotations

import torch

from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.batch_meta import BatchMeta
from shared.config import Qwen3Config


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype, device: torch.device):
        import flashinfer  # lazily: importing costs seconds, and CPU machines never need it

        self.cfg, self.dtype = cfg, dtype
        self.workspace = torch.zeros(fa.WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # zeroed: required
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(**fa.prefill_init_kwargs(self.workspace))
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(**fa.decode_init_kwargs(self.workspace, cfg))
        self._wrapper = None
        self._planned: BatchMeta | None = None

    def plan(self, meta: BatchMeta) -> None:
        # One token per request: the decode kernel (also right for a batch of 1-token prompts).
        if meta.decode_only:
            self.decode.plan(**fa.decode_plan_kwargs(meta, self.cfg, self.dtype))
            self._wrapper = self.decode
        else:
            self.prefill.plan(**fa.prefill_plan_kwargs(meta, self.cfg, self.dtype))
            self._wrapper = self.prefill
        self._planned = meta

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        if meta is not self._planned:
            raise RuntimeError("run() called with metadata that was not planned: call plan(meta) first")
        return self._wrapper.run(**fa.run_kwargs(q, k_cache, v_cache))
