"""L10's engine: L9's (L8's, with abort), over a model split across ranks. Rank 0 runs all of it; the
scheduler, the block manager and the prefix cache never learn that the model is split. Two things change:
the runner sends each step to the other ranks, and copy-on-write waits for that step (block_manager.py).
The followers are also told the engine's limits once, so they can refuse a message longer than a step."""
from __future__ import annotations

from lessons.l6_prefix_sharing.scheduler import PrefixScheduler
from lessons.l9_server.engine import L9Engine
from lessons.l10_tensor_parallel.block_manager import DeferredCopyManager
from lessons.l10_tensor_parallel.runner import TpRunner


class L10Engine(L9Engine):
    runner_class = TpRunner
    block_manager_class = DeferredCopyManager

    def make_scheduler(self, max_running: int) -> PrefixScheduler:
        scheduler = super().make_scheduler(max_running)
        # The first point where both limits are known, and before the graph capture and any step: each follower
        # checks every later message's length against them before it allocates the payload (wire.Limits).
        self.model.tp.send_limits(max_running, self.max_batched_tokens)
        return scheduler

    def close(self) -> None:
        """Stop the followers (they are waiting for the next step) and leave the process groups."""
        self.model.tp.close()
