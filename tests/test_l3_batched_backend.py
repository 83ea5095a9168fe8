"""The batched backend against the torch oracle on random ragged batches, and its padded page table.

Tolerances: fp32 within atol = rtol = 1e-5 of the oracle (both are exact attention; only the order of
the sums differs). bf16 within atol = rtol = 2e-2 of the oracle run in fp32 on the same bf16 inputs:
a bf16 output is itself rounded to 2^-8 relative, and the two paths round the softmax differently.
"""
from __future__ import annotations

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends.batched_backend import BatchedBackend, plan_decodes
from lessons.l3_block_tensor.backends.torch_backend import TorchBackend
from lessons.l3_block_tensor.batch_meta import BatchMeta

CPU = torch.device("cpu")
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}  # measured 6.6e-7 (Intel Xeon AMX), 6.0e-7 (torch capped to AVX2): 19x margin
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}  # measured 7.8e-3 (Intel Xeon AMX; torch capped to AVX2 the same): 8x margin


def ragged_batch(seed: int, s: int, hq: int, hkv: int, d: int, kinds: str, dtype: torch.dtype = torch.float32):
    """One request per letter of `kinds`: d = decode (one new token), p = whole-prompt prefill,
    c = continued prefill (several new tokens after a cached history). Histories 1 .. 400 tokens,
    pages scattered over a pool of random K/V so a wrong page or a padding key changes the output."""
    g = torch.Generator().manual_seed(seed)
    kv_lens = [int(n) for n in torch.randint(1, 401, (len(kinds),), generator=g)]
    kv_lens[0] = 1  # a one-token history: a decode row with a single key, or a 1-token prompt
    num_blocks = sum(-(-n // s) for n in kv_lens) + 4
    free = torch.randperm(num_blocks, generator=g).tolist()
    reqs = []
    for kind, kv_len in zip(kinds, kv_lens):
        q_len = {"d": 1, "p": kv_len, "c": min(kv_len, 1 + int(torch.randint(1, 40, (1,), generator=g)))}[kind]
        blocks = [free.pop() for _ in range(-(-kv_len // s))]
        reqs.append(Request(list(range(kv_len)), s, blocks=blocks, num_cached=kv_len - q_len))
    meta = BatchMeta.build(reqs, s, CPU)
    k_pages = torch.randn(num_blocks, s, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(num_blocks, s, hkv, d, generator=g).to(dtype)
    q = torch.randn(meta.num_tokens, hq, d, generator=g).to(dtype)
    return meta, q, k_pages, v_pages


def run(backend, meta: BatchMeta, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
    backend.plan(meta)
    return backend.run(q, k_pages, v_pages, meta)


# Decodes before, between and after prefills, so rows must go back to their own place in the stream.
MIXED = "dpdcddpdcd"


@pytest.mark.task("L3.6")
@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("d", [64, 128])
def test_mixed_batch_matches_oracle_fp32(s: int, hq: int, hkv: int, d: int):
    meta, q, k_pages, v_pages = ragged_batch(seed=s * 1000 + hq * 10 + d, s=s, hq=hq, hkv=hkv, d=d, kinds=MIXED)
    want = run(TorchBackend(), meta, q, k_pages, v_pages)
    got = run(BatchedBackend(), meta, q, k_pages, v_pages)
    assert got.shape == want.shape == q.shape
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.task("L3.6")
@pytest.mark.parametrize("s", [1, 16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 128), (8, 1, 64)])
def test_decode_only_batch_matches_oracle_fp32(s: int, hq: int, hkv: int, d: int):
    # Every request feeds one token: run() takes its no-scatter shortcut, which mixed batches never reach.
    meta, q, k_pages, v_pages = ragged_batch(seed=7 + s + d, s=s, hq=hq, hkv=hkv, d=d, kinds="d" * 12)
    assert meta.decode_only
    torch.testing.assert_close(run(BatchedBackend(), meta, q, k_pages, v_pages),
                               run(TorchBackend(), meta, q, k_pages, v_pages), **FP32_TOL)


@pytest.mark.task("L3.6")
@pytest.mark.parametrize("kinds", [MIXED, "dddddddd"])
@pytest.mark.parametrize("s,hq,hkv,d", [(7, 6, 2, 64), (16, 8, 1, 128)])
def test_bf16_matches_fp32_oracle(kinds: str, s: int, hq: int, hkv: int, d: int):
    meta, q, k_pages, v_pages = ragged_batch(seed=3 + s, s=s, hq=hq, hkv=hkv, d=d, kinds=kinds, dtype=torch.bfloat16)
    got = run(BatchedBackend(), meta, q, k_pages, v_pages)
    assert got.dtype == torch.bfloat16
    want = run(TorchBackend(), meta, q.float(), k_pages.float(), v_pages.float())
    torch.testing.assert_close(got.float(), want, **BF16_TOL)


@pytest.mark.task("L3.6")
def test_worked_example_padded_table_and_mask():
    # The lesson doc's example: S = 4, three decode requests holding 2, 5 and 3 pages.
    s, tables, kv_lens = 4, [[7, 2], [0, 9, 4, 11, 5], [3, 8, 1]], [6, 19, 12]
    reqs = [Request(list(range(n)), s, blocks=t, num_cached=n - 1) for t, n in zip(tables, kv_lens)]
    plan = plan_decodes(BatchMeta.build(reqs, s, CPU), [0, 1, 2])
    assert plan.max_pages == 5
    assert plan.pages.view(3, 5).tolist() == [[7, 2, 7, 7, 7], [0, 9, 4, 11, 5], [3, 8, 1, 3, 3]]
    assert plan.key_mask.shape == (3, 1, 1, 20)
    assert plan.key_mask[:, 0, 0].sum(dim=1).tolist() == kv_lens  # exactly each history, from key 0
    assert plan.key_mask[:, 0, 0].int().diff(dim=1).le(0).all()  # True then False, never True again
    assert plan.rows.tolist() == [0, 1, 2]


def test_buffers_are_reused_across_layers_and_outputs_are_not_views_of_them():
    meta, q, k_pages, v_pages = ragged_batch(seed=11, s=4, hq=4, hkv=2, d=64, kinds="dddd")
    backend = BatchedBackend()
    backend.plan(meta)
    first = backend.run(q, k_pages, v_pages, meta)
    buffer = backend._buffers.store["k"]
    kept = first.clone()
    backend.run(q, k_pages.flip(0), v_pages.flip(0), meta)  # the next layer overwrites the gather buffers
    assert backend._buffers.store["k"] is buffer
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


@pytest.mark.task("L3.6")
def test_run_without_plan_is_refused():
    meta, q, k_pages, v_pages = ragged_batch(seed=0, s=4, hq=4, hkv=2, d=64, kinds="dpd")
    other, *_ = ragged_batch(seed=1, s=4, hq=4, hkv=2, d=64, kinds="dpd")
    backend = BatchedBackend()
    with pytest.raises(RuntimeError, match="plan"):
        backend.run(q, k_pages, v_pages, meta)
    backend.plan(other)
    with pytest.raises(RuntimeError, match="plan"):
        backend.run(q, k_pages, v_pages, meta)
