"""L10's engine: L9's (L8's, with abort), over a model split across ranks. Rank 0 runs all of it; the
scheduler, the block manager and the prefix cache never learn that the model is split. Two things change:
the runner sends each step to the other ranks, and copy-on-write waits for that step (block_manager.py)."""
from __future__ import annotations

from lessons.l9_server.engine import L9Engine
from lessons.l10_tensor_parallel.block_manager import DeferredCopyManager
from lessons.l10_tensor_parallel.runner import TpRunner


class L10Engine(L9Engine):
    runner_class = TpRunner
    block_manager_class = DeferredCopyManager

    def close(self) -> None:
        """Stop the followers (they are waiting for the next step) and leave the process groups."""
        self.model.tp.close()
