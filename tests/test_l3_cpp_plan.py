"""The C++ kernel's plan (paged_attention.cpp `plan`, cpp_backend.CppBackend.plan): the work items are cut once per
step and every layer's run reuses them, as FlashInfer plans once per step; a plan that does not fit the step it
is run with is an error, not a read outside the pool. And the kernel's vector exp against the exact one.
"""
from __future__ import annotations

import pytest
import torch

from lessons.l3_block_tensor.backends import CppBackend, cpp_backend
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from test_l3_cpp_backend import FP32_TOL, MIXED, batch, needs_kernel

# Columns of a work item (the kernel's ItemField): request, rows [begin, end), first new position, the request's
# first row, and KV-head chunk c of n.
REQUEST, ROW_BEGIN, ROW_END, FIRST_POS, ROW0, CHUNK, CHUNKS = range(7)


class CountingKernel:
    """The kernel module with its plan() calls counted."""

    def __init__(self, kernel) -> None:
        self.kernel, self.plans = kernel, 0

    def plan(self, *args):
        self.plans += 1
        return self.kernel.plan(*args)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


@needs_kernel
def test_one_plan_serves_every_layer_of_the_step():
    meta, q, k, v = batch(seed=4, s=16, hq=8, hkv=4, d=64, rows=MIXED)
    backend = CppBackend()
    backend.kernel = CountingKernel(backend.kernel)
    backend.plan(meta)
    work = backend._work
    oracle = TorchBackend()
    oracle.plan(meta)
    for layer in range(3):  # each layer its own K/V pool, the same tables
        k_layer, v_layer = k * (layer + 1), v.flip(0)
        torch.testing.assert_close(backend.run(q, k_layer, v_layer, meta), oracle.run(q, k_layer, v_layer, meta),
                                   **FP32_TOL)
    assert backend.kernel.plans == 1
    assert backend._work is work  # the same items, not re-derived per layer


@needs_kernel
def test_the_plan_cuts_row_tiles_longest_first():
    # (history, new rows): a decode, a 20-row prompt (tiles of 8, 8, 4) and a 3-row slice of a longer history.
    meta, *_ = batch(seed=1, s=4, hq=4, hkv=2, d=64, rows=[(10, 1), (20, 20), (30, 3)])
    kernel = cpp_backend.load_kernel()
    tables = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 4, 1)
    # By default a tile holds up to 32 rows: the whole prompt is one item, and the costliest.
    assert kernel.plan(*tables).tolist() == [[1, 1, 21, 0, 1, 0, 1], [2, 21, 24, 27, 21, 0, 1], [0, 0, 1, 9, 0, 0, 1]]
    items = kernel.plan(*tables, tile_rows=8)
    assert items.dtype == torch.int64
    # Rows 0 | 1..20 | 21..23. Cost = rows x the keys the tile's last row sees: rows 9..16 8 x 16 = 128, the
    # slice 3 x 30 = 90, rows 17..20 4 x 20 = 80, rows 1..8 8 x 8 = 64, the decode 1 x 10 = 10.
    assert items.tolist() == [
        [1, 9, 17, 0, 1, 0, 1],
        [2, 21, 24, 27, 21, 0, 1],
        [1, 17, 21, 0, 1, 0, 1],
        [1, 1, 9, 0, 1, 0, 1],
        [0, 0, 1, 9, 0, 0, 1],
    ]


@needs_kernel
def test_fewer_tiles_than_threads_split_the_kv_heads():
    meta, q, k, v = batch(seed=2, s=16, hq=8, hkv=4, d=64, rows=[(401, 1)])
    kernel = cpp_backend.load_kernel()
    tables = (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, 16)
    assert kernel.plan(*tables, 1)[:, [CHUNK, CHUNKS]].tolist() == [[0, 1]]
    # One tile, two threads: chunks for up to 8 items a thread, at most 8; past the 4 KV heads half have no
    # head, and do nothing.
    split = kernel.plan(*tables, 2)
    assert split[:, [CHUNK, CHUNKS]].tolist() == [[c, 8] for c in range(8)]
    want = kernel.run_planned(q, k, v, meta.kv_indptr, meta.kv_indices, kernel.plan(*tables, 1))
    assert torch.equal(kernel.run_planned(q, k, v, meta.kv_indptr, meta.kv_indices, split), want)
    # Enough tiles (24 decodes, 2 threads: 12 items each): every item keeps all heads, each page read once.
    many, *_ = batch(seed=2, s=16, hq=8, hkv=4, d=64, rows=[(100 + i, 1) for i in range(24)])
    tables = (many.qo_indptr, many.kv_indptr, many.kv_indices, many.kv_last_page_len, 16)
    assert kernel.plan(*tables, 2)[:, CHUNKS].tolist() == [1] * 24


@needs_kernel
def test_a_plan_from_another_step_is_an_error_not_a_read_outside_the_pool():
    kernel = cpp_backend.load_kernel()
    long_meta, *_ = batch(seed=3, s=4, hq=4, hkv=2, d=64, rows=[(40, 8)])
    meta, q, k, v = batch(seed=3, s=4, hq=4, hkv=2, d=64, rows=[(9, 1)])
    stale = kernel.plan(long_meta.qo_indptr, long_meta.kv_indptr, long_meta.kv_indices,
                        long_meta.kv_last_page_len, 4, 1)
    with pytest.raises(RuntimeError, match="work item 0 does not fit this step's q and page tables"):
        kernel.run_planned(q, k, v, meta.kv_indptr, meta.kv_indices, stale)
    with pytest.raises(RuntimeError, match=r"work items must be plan\(\)'s int64 tensor"):
        kernel.run_planned(q, k, v, meta.kv_indptr, meta.kv_indices, stale.int())


@needs_kernel
def test_the_vector_exp_is_within_two_ulp_of_exp():
    # Every weight the kernel computes is exp(score - running max) <= 1: x from -87 (where it clamps) to 0.
    x = torch.cat([torch.linspace(-87.0, 0.0, 1_000_003), torch.tensor([-0.0, -1e-30, -1e-7, -0.5, -0.34657359])])
    got = cpp_backend.load_kernel().vector_exp(x).double()
    exact = torch.exp(x.double())
    ulp = (torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double())
    # measured 0.99 ulp (Intel Xeon AMX; built -march=haswell, torch capped to AVX2, the same): 2x margin
    assert ((got - exact).abs() / ulp).max().item() <= 2.0
    assert got[x == 0].tolist() == [1.0, 1.0]
    below = cpp_backend.load_kernel().vector_exp(torch.tensor([-100.0, -float("inf")] * 4))
    assert (below > 0).all() and (below < 2e-38).all()  # clamped at -87: tiny, never NaN; masked where it matters
