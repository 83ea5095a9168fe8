"""L7's CUDA path without a GPU: every call cuda_graph.py makes (the graph-mode decode wrapper, its plan and
run, torch's CUDA-graph capture and replay) binds to the installed libraries' signatures, with the exact
arguments graph_args.py and L3's flashinfer_args.py build from a captured size's metadata.

CI installs the flashinfer extra, so there this never skips. It catches API drift (a renamed keyword such as
paged_kv_indptr_buffer vs _buf); it does not prove a graph replays correctly.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l7_cuda_graphs import L7Engine
from lessons.l7_cuda_graphs import graph_args as ga

flashinfer = pytest.importorskip("flashinfer")

SELF = object()  # stands in for an instance: constructing a wrapper or a graph needs a GPU
CPU = torch.device("cpu")


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    return inspect.signature(fn).bind(*args, **kwargs)


@pytest.fixture(scope="module")
def runner(tiny_model):
    """The CPU runner builds the same per-size metadata the CUDA path plans with."""
    return L7Engine(tiny_model, 4, 32, 8, "torch", capture_sizes=[1, 2, 4, 8]).runner


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_graph_mode_decode_calls_bind(tiny_model, runner, size, dtype):
    cfg, wrapper = tiny_model.config, flashinfer.BatchDecodeWithPagedKVCacheWrapper
    max_pages = runner.buffers.max_pages
    indptr, indices, last = ga.page_table_buffers(size, max_pages, CPU)
    ws = torch.zeros(16, dtype=torch.uint8)
    init = bind(wrapper.__init__, SELF, **ga.graph_decode_init_kwargs(ws, cfg, indptr, indices, last)).arguments
    assert init["use_cuda_graph"] is True and init["paged_kv_last_page_len_buffer"] is last
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32

    meta = runner.step_meta(runner.steps[size])  # what forward() plans: kv_indices cut to the step's pages
    kwargs = fa.decode_plan_kwargs(meta, cfg, dtype)
    bind(wrapper.plan, SELF, **kwargs)
    impl = bind(wrapper._plan_impl, SELF, **kwargs).arguments  # plan(**kwargs) forwards here: bind what checks
    # Graph mode fixes the batch at len(last_page_len buffer); plan raises on any other batch size.
    assert impl["last_page_len"].numel() == last.numel() == size and impl["indptr"].numel() == indptr.numel()
    assert impl["indices"].numel() <= indices.numel(), "plan copies the step's indices into the buffer"
    assert impl["q_data_type"] == dtype and impl["pos_encoding_mode"] == "NONE"

    q = torch.zeros(size, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
    k = torch.zeros(4, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    run = bind(wrapper.run, SELF, **fa.run_kwargs(q, k, k.clone())).arguments
    assert run["q"].shape[0] == meta.batch_size == size


def test_cuda_graph_calls_bind():
    bind(torch.cuda.graph.__init__, SELF, **ga.graph_capture_kwargs(SELF, SELF))
    bind(torch.cuda.CUDAGraph.replay, SELF)
    bind(torch.cuda.CUDAGraph.__init__, SELF)
    bind(torch.cuda.graph_pool_handle)
    bind(torch.cuda.stream, SELF)
    bind(torch.cuda.Stream.wait_stream, SELF, SELF)


def test_every_call_in_the_cuda_path_goes_through_the_checked_kwargs():
    """cuda_graph.py builds its arguments only with graph_args / flashinfer_args: the bindings above are its calls."""
    from lessons.l7_cuda_graphs import cuda_graph

    src = inspect.getsource(cuda_graph)
    for call in ("BatchDecodeWithPagedKVCacheWrapper(", ".plan(", ".run(", "torch.cuda.graph("):
        lines = [ln for ln in src.splitlines() if call in ln and not ln.strip().startswith(("#", "def "))]
        assert lines, f"cuda_graph.py no longer calls {call}: update this test"
        for line in lines:
            assert "**ga." in line or "**fa." in line, f"a call not built by graph_args / flashinfer_args: {line.strip()}"
