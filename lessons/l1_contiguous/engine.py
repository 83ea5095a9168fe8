"""L1's engine: reserve max_seq_len rows up front, prefill the prompt, then decode one token a step."""
from __future__ import annotations

import torch

from lessons.l1_contiguous.kv_cache import ContiguousKvCache, ContiguousMeta
from shared.generation import StopRule, check_prompt
from shared.model import Qwen3ForCausalLM


class L1Engine:
    def __init__(self, model: Qwen3ForCausalLM):
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype

    # Task L1.3: prefill the prompt once, then decode one token a step until the stop rule
    def generate(self, prompt_ids: list[int], stop: StopRule) -> list[int]:
        check_prompt(prompt_ids, stop, self.model.config)
        # The last generated token is never fed back, so the cache needs one row less than the total.
        cache = ContiguousKvCache(self.model.config, len(prompt_ids) + stop.max_new_tokens - 1, self.dtype, self.device)
        tokens = torch.tensor(prompt_ids, device=self.device)
        start, out = 0, []
        while True:
            positions = torch.arange(start, start + len(tokens), device=self.device)
            hidden = self.model(tokens, positions, cache, ContiguousMeta(start))
            out.append(int(self.model.logits(hidden[-1:]).argmax(dim=-1)))
            if stop.is_done(out):
                return out
            start += len(tokens)
            tokens = torch.tensor(out[-1:], device=self.device)
