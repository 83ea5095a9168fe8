"""L7's engine: L6's, on the graph runner, with one block of the pool reserved for padded rows."""
from __future__ import annotations

from lessons.l2_token_flat.engine import pool_blocks
from lessons.l4_continuous.engine import DEFAULT_MAX_RUNNING
from lessons.l6_prefix_sharing.engine import L6Engine
from lessons.l7_cuda_graphs.capture_sizes import check_capture_sizes, default_capture_sizes
from lessons.l7_cuda_graphs.graph_runner import GraphRunner
from shared.model import Qwen3ForCausalLM


class L7Engine(L6Engine):
    runner_class: type[GraphRunner] = GraphRunner  # L8 swaps in its slice-aware subclass

    def __init__(self, model: Qwen3ForCausalLM, block_size: int = 16, num_blocks: int | None = None,
                 max_running: int = DEFAULT_MAX_RUNNING, backend: str = "auto", *, graphs: bool = True,
                 capture_sizes: list[int] | None = None, **kwargs):
        num_blocks = pool_blocks(block_size, num_blocks)
        # One block more than asked for: the dummy block. Requests still get num_blocks, as in L6.
        runner = self.runner_class(model, block_size, num_blocks + 1, backend)
        super().__init__(model, block_size, num_blocks, max_running, backend, runner=runner, **kwargs)
        sizes = default_capture_sizes(max_running) if capture_sizes is None else list(capture_sizes)
        sizes = check_capture_sizes(sizes, max_running) if graphs else []
        # Taken from the ref-counted manager and never returned: held forever, so no request is ever given
        # the block padded rows write into.
        self.dummy_block = self.allocator.alloc(1)[0]
        self.scheduler.capacity = num_blocks  # so a request needing the dummy block too is refused at submission
        self.runner.capture(sizes, self.dummy_block)

    @property
    def usable_blocks(self) -> int:
        return self.allocator.num_blocks - 1
