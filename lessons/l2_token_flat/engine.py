"""L2's engine: the L1 loop, with blocks reserved as the request grows and freed when it ends."""
from __future__ import annotations

import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.forward_meta import ForwardMeta
from lessons.l2_token_flat.kv_pool import KvPool
from lessons.l2_token_flat.request import Request
from shared.errors import CourseError
from shared.generation import StopRule, check_prompt
from shared.model import Qwen3ForCausalLM

DEFAULT_POOL_TOKENS = 4096


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def pool_blocks(block_size: int, num_blocks: int | None) -> int:
    """Check the pool options every paged lesson takes; None means DEFAULT_POOL_TOKENS' worth of blocks."""
    if block_size < 1:
        raise CourseError(f"block-size must be at least 1, got {block_size}")
    if num_blocks is None:
        return blocks_for(DEFAULT_POOL_TOKENS, block_size)
    if num_blocks < 1:
        raise CourseError(f"num-blocks must be at least 1, got {num_blocks}")
    return num_blocks


class L2Engine:
    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None):
        num_blocks = pool_blocks(block_size, num_blocks)
        self.model, self.block_size = model, block_size
        self.device = model.lm_head.weight.device
        self.allocator = BlockAllocator(num_blocks)
        self.pool = KvPool(model.config, num_blocks * block_size, model.lm_head.weight.dtype, self.device)

    def check_fits(self, prompt_ids: list[int], stop: StopRule) -> None:
        """Refuse up front a request the whole pool could never hold (the last token is never cached)."""
        need = blocks_for(len(prompt_ids) + stop.max_new_tokens - 1, self.block_size)
        if need > self.allocator.num_blocks:
            raise CourseError(
                f"prompt ({len(prompt_ids)} tokens) + max-new-tokens ({stop.max_new_tokens}) needs {need} blocks of "
                f"{self.block_size} tokens; the pool has {self.allocator.num_blocks}"
            )

    # Task L2.6: L1's loop over the pool: reserve, feed, sample, free every block at the end
    def generate(self, prompt_ids: list[int], stop: StopRule) -> list[int]:
        """check_fits before any forward; each step feeds only the tokens not yet cached; every block freed at the
        end, on success or failure."""
        check_prompt(prompt_ids, stop, self.model.config)
        self.check_fits(prompt_ids, stop)
        req = Request(list(prompt_ids), self.block_size)
        try:
            while True:
                req.reserve(req.num_tokens, self.allocator)
                meta = ForwardMeta.for_step(req, self.device)
                tokens = torch.tensor((req.prompt_ids + req.output_ids)[req.num_cached:], device=self.device)
                hidden = self.model(tokens, meta.positions, self.pool, meta)
                req.num_cached = req.num_tokens
                req.output_ids.append(int(self.model.logits(hidden[-1:]).argmax(dim=-1)))
                if stop.is_done(req.output_ids):
                    return req.output_ids
        finally:
            self.allocator.free(req.blocks)  # on success and on any failure: no block leaks
            req.blocks = []
