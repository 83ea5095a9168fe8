"""L5's engine: L4's engine with the preempting scheduler (and a host pool for the swap policy)."""
from __future__ import annotations

from lessons.l4_continuous.engine import L4Engine
from lessons.l4_continuous.scheduler import Scheduler
from lessons.l5_preemption.host_pool import HostKvPool
from lessons.l5_preemption.scheduler import PreemptingScheduler
from shared.errors import CourseError


class L5Engine(L4Engine):
    def __init__(self, *args, policy: str = "recompute", host_blocks: int | None = None, **kwargs):
        self.policy, self.host_blocks = policy, host_blocks
        super().__init__(*args, **kwargs)

    def make_scheduler(self, max_running: int) -> Scheduler:
        host = None
        if self.policy == "swap":
            n = self.host_blocks if self.host_blocks is not None else self.allocator.num_blocks
            if n < 1:
                raise CourseError(f"host-blocks must be at least 1, got {n}")
            host = HostKvPool(self.runner.pool, n)
        return PreemptingScheduler(self.allocator, self.block_size, max_running, self.policy, host, self.stats)
