"""L4's per-step stats plus what prefix sharing saves and costs."""
from __future__ import annotations

from dataclasses import dataclass

from lessons.l4_continuous.stats import EngineStats


@dataclass
class PrefixStats(EngineStats):
    prompt_tokens: int = 0  # tokens admissions needed in KV (a re-admission counts its generated tokens too)
    cached_tokens: int = 0  # of those, served from the prefix cache
    prefill_tokens: int = 0  # of those, computed: prompt_tokens - cached_tokens
    evictions: int = 0  # cached blocks dropped to make room
    cow_copies: int = 0  # shared blocks copied before a write

    def prefix_line(self) -> str:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (f"{self.prompt_tokens} prompt tokens, {self.cached_tokens} served from the cache ({share:.0%}), "
                f"{self.prefill_tokens} prefilled, {self.evictions} eviction(s), {self.preemptions} preemption(s), "
                f"{self.cow_copies} copy-on-write")
