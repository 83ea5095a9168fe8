"""What the engine measures each step: how full the reserved KV really is, and who holds which blocks."""
from __future__ import annotations

from dataclasses import dataclass, field

from lessons.l4_continuous.sequence import Sequence


@dataclass
class EngineStats:
    steps: int = 0
    tokens_held: list[int] = field(default_factory=list)  # per step: K/V entries actually written
    slots_reserved: list[int] = field(default_factory=list)  # per step: allocated blocks x block size
    running: list[int] = field(default_factory=list)  # per step: requests in the batch
    timeline: list[dict[int, int]] = field(default_factory=list)  # per step: seq_id -> blocks held
    preemptions: int = 0  # L5: requests evicted to make room
    swaps_out: int = 0  # L5: evictions whose KV went to host memory instead of being dropped
    swaps_in: int = 0
    record_timeline: bool = True

    def record(self, batch: list[Sequence], allocated_blocks: int, block_size: int) -> None:
        """Called after the forward (num_cached updated) and before finished requests free their blocks."""
        self.steps += 1
        self.tokens_held.append(sum(s.num_cached for s in batch))
        self.slots_reserved.append(allocated_blocks * block_size)
        self.running.append(len(batch))
        if self.record_timeline:
            self.timeline.append({s.seq_id: len(s.blocks) for s in batch})

    @property
    def utilization_mean(self) -> float:
        """Mean over steps of tokens held / slots reserved (1.0 = no slot reserved ahead of its token)."""
        ratios = [t / r for t, r in zip(self.tokens_held, self.slots_reserved) if r]
        return sum(ratios) / len(ratios) if ratios else 0.0

    @property
    def utilization_at_peak(self) -> float:
        """tokens held / slots reserved at the step that reserved the most slots."""
        if not self.slots_reserved:
            return 0.0
        i = max(range(len(self.slots_reserved)), key=self.slots_reserved.__getitem__)
        return self.tokens_held[i] / self.slots_reserved[i]

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)
