"""The exact arguments of every CUDA-graph call the lesson makes, as pure functions.

The CUDA path (cuda_graph.py) builds its calls only from these, and tests/test_l7_flashinfer_contract.py
binds them to the installed FlashInfer's and torch's signatures: no GPU was lent to this project, so that
binding is what guards the graph path against a renamed argument. Nothing here imports flashinfer.
"""
from __future__ import annotations

from typing import Any

import torch

from lessons.l3_block_tensor.backends import flashinfer_args as fa
from shared.config import Qwen3Config


def page_table_buffers(size: int, max_pages: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device arrays a graph-mode decode wrapper reads: indptr [size+1], indices [max_pages],
    last_page_len [size], int32. plan() copies the step's host page table into them; the graph reads them."""
    return (torch.zeros(size + 1, dtype=torch.int32, device=device),
            torch.zeros(max_pages, dtype=torch.int32, device=device),
            torch.zeros(size, dtype=torch.int32, device=device))


def graph_decode_init_kwargs(workspace: torch.Tensor, cfg: Qwen3Config, indptr: torch.Tensor, indices: torch.Tensor,
                             last_page_len: torch.Tensor) -> dict[str, Any]:
    # use_cuda_graph fixes the batch size at len(last_page_len): one wrapper per captured size.
    return {
        "float_workspace_buffer": workspace,
        "kv_layout": "NHD",
        "use_cuda_graph": True,
        "use_tensor_cores": fa.use_tensor_cores(cfg),
        "paged_kv_indptr_buffer": indptr,  # the decode wrapper spells these *_buffer (the prefill one: *_buf)
        "paged_kv_indices_buffer": indices,
        "paged_kv_last_page_len_buffer": last_page_len,
    }


def graph_capture_kwargs(graph: Any, pool: Any) -> dict[str, Any]:
    """torch.cuda.graph(...): every size captures into one memory pool, so the graphs share their
    intermediates (only one replays at a time) instead of each holding its own."""
    return {"cuda_graph": graph, "pool": pool}
