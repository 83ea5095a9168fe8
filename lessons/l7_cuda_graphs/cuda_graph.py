"""The CUDA-only part: FlashInfer's graph-mode decode wrapper, and capturing a step into a CUDA graph.

Never run in this project (no GPU was lent); written against the checked API facts and guarded by
tests/test_l7_flashinfer_contract.py, which binds every call's arguments (built in graph_args.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l7_cuda_graphs import graph_args as ga
from shared.config import Qwen3Config


class GraphDecodeBackend:
    """L3's backend interface for one captured size: plan() outside the graph, run() captured."""

    name = "flashinfer-graph"

    def __init__(self, cfg: Qwen3Config, dtype: torch.dtype, size: int, max_pages: int, workspace: torch.Tensor):
        import flashinfer  # lazily, as in L3: CPU machines never need it

        self.cfg, self.dtype = cfg, dtype
        self.buffers = ga.page_table_buffers(size, max_pages, workspace.device)  # kept alive: the graph reads them
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(**ga.graph_decode_init_kwargs(workspace, cfg, *self.buffers))

    def plan(self, meta: BatchMeta) -> None:
        # Host work (reads the page table, picks a split, copies into self.buffers): never inside the graph.
        self.wrapper.plan(**fa.decode_plan_kwargs(meta, self.cfg, self.dtype))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        return self.wrapper.run(**fa.run_kwargs(q, k_cache, v_cache))


def new_workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(fa.WORKSPACE_BYTES, dtype=torch.uint8, device=device)  # shared: one graph replays at a time


def new_pool() -> object:
    return torch.cuda.graph_pool_handle()


def capture(forward: Callable[[], torch.Tensor], pool: object) -> Callable[[], torch.Tensor]:
    """Record forward() once; return a replay that reruns its kernels and returns the same output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up off the capture: lazy init (cuBLAS handles, kernel JIT) must not be recorded
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(**ga.graph_capture_kwargs(graph, pool)):
        out = forward()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay
