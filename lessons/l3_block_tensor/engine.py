"""L3's engine: a static batch. Reserve, prefill every request in one ragged forward, decode together.

Each request stops on its own rule and frees its blocks at once; the batch never grows (that is L4).
"""
from __future__ import annotations

from lessons.l2_token_flat.engine import blocks_for, pool_blocks
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import AttentionBackend
from lessons.l3_block_tensor.runner import PagedRunner
from shared.errors import CourseError
from shared.generation import StopRule, check_prompt
from shared.model import Qwen3ForCausalLM


class L3Engine:
    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None,
                 backend: str | AttentionBackend = "auto"):
        num_blocks = pool_blocks(block_size, num_blocks)
        self.model, self.block_size = model, block_size
        self.runner = PagedRunner(model, block_size, num_blocks, backend)
        self.allocator = self.runner.allocator

    # Task L3.5: the static batch: refuse what cannot fit at its longest; step all, each stops and frees on its own
    def check_fits(self, prompts: list[list[int]], stop: StopRule) -> None:
        """A static batch runs to the end together, so all of it must fit at once, at its longest."""
        need = sum(blocks_for(len(p) + stop.max_new_tokens - 1, self.block_size) for p in prompts)  # last token never cached
        if need > self.allocator.num_free:
            raise CourseError(
                f"a batch of {len(prompts)} request(s) with max-new-tokens {stop.max_new_tokens} needs {need} blocks "
                f"of {self.block_size} tokens; the pool has {self.allocator.num_free} free of {self.allocator.num_blocks}"
            )

    # Task L3.5: the static batch: refuse what cannot fit at its longest; step all, each stops and frees on its own
    def generate_batch(self, prompts: list[list[int]], stop: StopRule) -> list[list[int]]:
        for p in prompts:
            check_prompt(p, stop, self.model.config)
        self.check_fits(prompts, stop)
        requests = [Request(list(p), self.block_size) for p in prompts]
        active = list(requests)
        try:
            while active:
                for r in active:
                    r.reserve(r.num_tokens, self.allocator)  # cannot fail: check_fits counted the longest case
                next_ids = self.runner.forward(active).argmax(dim=-1).tolist()
                for r, t in zip(active, next_ids):
                    r.output_ids.append(t)
                    if stop.is_done(r.output_ids):
                        self.allocator.free(r.blocks)  # at once: a later request (L4) could use them
                        r.blocks = []
                active = [r for r in active if not stop.is_done(r.output_ids)]
            return [r.output_ids for r in requests]
        finally:
            for r in requests:  # on a failure mid-batch: no block leaks
                self.allocator.free(r.blocks)
                r.blocks = []

    def generate(self, prompt_ids: list[int], stop: StopRule) -> list[int]:
        return self.generate_batch([prompt_ids], stop)[0]
