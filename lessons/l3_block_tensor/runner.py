"""One ragged forward for many requests: the model's attention seam, backed by the block-tensor pool.

The runner owns the pool, the block allocator and the backend. Callers (the engine here, a scheduler in
L4) decide which requests step and reserve their blocks; `forward` does the rest.
"""
from __future__ import annotations

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import AttentionBackend, make_backend
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l3_block_tensor.kv_pool import BlockKvPool
from shared.config import Qwen3Config
from shared.model import Qwen3ForCausalLM


class PagedRunner:
    def __init__(self, model: Qwen3ForCausalLM, block_size: int, num_blocks: int, backend: str | AttentionBackend = "auto"):
        self.model, self.block_size = model, block_size
        self.device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        self.allocator = BlockAllocator(num_blocks)
        self.pool = self.make_pool(model.config, num_blocks, block_size, dtype)
        self.backend = self.make_backend(backend, dtype) if isinstance(backend, str) else backend

    # Two seams for L12, whose pool stores int8 and whose backends read it.
    def make_pool(self, cfg: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype) -> BlockKvPool:
        return BlockKvPool(cfg, num_blocks, block_size, dtype, self.device)

    def make_backend(self, name: str, dtype: torch.dtype) -> AttentionBackend:
        return make_backend(name, self.model.config, dtype, self.device)

    # Task L3.4: one ragged forward: build the metadata, plan once, write then attend per layer -> logits [B, vocab]
    def forward(self, requests: list[Request]) -> torch.Tensor:
        """Feed every request's uncached tokens in one flat stream -> fp32 logits [B, vocab] of each one's last."""
        meta = BatchMeta.build(requests, self.block_size, self.device)
        ids = [t for r in requests for t in r.token_ids(r.num_cached, r.num_tokens)]  # the fed tokens only
        tokens = torch.tensor(ids, device=self.device)  # [T]: requests concatenated, no padding
        self.backend.plan(meta)  # once per step, before the first layer
        hidden = self.model(tokens, meta.positions, self, meta)
        for r in requests:
            r.num_cached = r.num_tokens
        return self.model.logits(hidden[meta.last_rows])

    # Task L3.4: one ragged forward: build the metadata, plan once, write then attend per layer -> logits [B, vocab]
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        # Write first: each request's new tokens must see themselves (the diagonal of the causal mask).
        self.pool.write(layer, k, v, meta.slot_mapping)
        return self.backend.run(q, self.pool.k[layer], self.pool.v[layer], meta)
