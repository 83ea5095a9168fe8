"""The CUDA path without a GPU: the exact kwargs our FlashInfer backend passes must bind to the installed
FlashInfer's signatures, and the metadata must meet FlashInfer's documented invariants.

It catches API drift (a renamed keyword, a new required argument); it does not prove the kernels right.
"""
from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.batch_meta import BatchMeta

flashinfer = pytest.importorskip("flashinfer")

CPU = torch.device("cpu")
SELF = object()  # stands in for a wrapper instance: constructing one needs a GPU
NUM_BLOCKS = 64


def qwen3_8b_like(cfg):
    return replace(cfg, num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # GQA 4: tensor cores


def step(kind: str, s: int) -> BatchMeta:
    """A mixed prefill step (prompts of 1, s, s+1, 3s+2 tokens, one with a cached prefix) or a decode step."""
    lengths, blocks, reqs, nxt = [1, s, s + 1, 3 * s + 2], list(range(NUM_BLOCKS))[::-1], [], 0
    for i, n in enumerate(lengths):
        pages = -(-n // s)
        cached = n - 1 if kind == "decode" else (n // 2 if i == 3 else 0)
        reqs.append(Request(list(range(n)), s, blocks=blocks[nxt: nxt + pages], num_cached=cached))
        nxt += pages
    return BatchMeta.build(reqs, s, CPU)


def check_invariants(m: BatchMeta, num_blocks: int) -> None:
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu", "index arrays: int32 on the host"
    b = m.kv_last_page_len.numel()
    assert m.qo_indptr.numel() == m.kv_indptr.numel() == b + 1
    assert m.qo_indptr[0] == 0 and m.kv_indptr[0] == 0
    assert bool((m.qo_indptr.diff() >= 1).all()), "every request feeds at least one query row"
    assert bool((m.kv_indptr.diff() >= 1).all()), "every request owns at least one page"
    assert m.kv_indptr[-1] == m.kv_indices.numel()
    assert bool(((m.kv_indices >= 0) & (m.kv_indices < num_blocks)).all())
    assert bool(((m.kv_last_page_len >= 1) & (m.kv_last_page_len <= m.block_size)).all())
    kv_len = (m.kv_indptr.diff() - 1) * m.block_size + m.kv_last_page_len
    assert bool((kv_len >= m.qo_indptr.diff()).all()), "queries are the tail of their history"
    assert m.qo_indptr[-1] == m.positions.numel() == m.slot_mapping.numel(), "q rows = qo_indptr[-1]"
    if m.decode_only:
        assert m.qo_indptr[-1] == b


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    return inspect.signature(fn).bind(*args, **kwargs)


@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("big", [False, True])
def test_kwargs_bind_to_installed_flashinfer(tiny_model, s, dtype, big):
    cfg = qwen3_8b_like(tiny_model.config) if big else tiny_model.config
    prefill_cls, decode_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper
    ws = torch.zeros(16, dtype=torch.uint8)  # the real one is fa.WORKSPACE_BYTES on the GPU
    bind(prefill_cls.__init__, SELF, **fa.prefill_init_kwargs(ws))
    bound = bind(decode_cls.__init__, SELF, **fa.decode_init_kwargs(ws, cfg))
    assert bound.arguments["use_tensor_cores"] == big  # 32/8 = 4 -> tensor cores; tiny 4/2 -> not

    prefill = step("prefill", s)
    check_invariants(prefill, NUM_BLOCKS)
    assert not prefill.decode_only
    plan = bind(prefill_cls.plan, SELF, **fa.prefill_plan_kwargs(prefill, cfg, dtype)).arguments
    assert plan["causal"] is True and plan["q_data_type"] == dtype and plan["kv_data_type"] == dtype
    assert plan["page_size"] == s and plan["head_dim_qk"] == cfg.head_dim

    decode = step("decode", s)
    check_invariants(decode, NUM_BLOCKS)
    assert decode.decode_only
    kwargs = fa.decode_plan_kwargs(decode, cfg, dtype)
    bind(decode_cls.plan, SELF, **kwargs)
    # decode.plan takes **kwargs and forwards them to _plan_impl: bind there too, or any typo would pass.
    impl = bind(decode_cls._plan_impl, SELF, **kwargs).arguments
    assert impl["q_data_type"] == dtype and impl["pos_encoding_mode"] == "NONE"

    pages = torch.zeros(NUM_BLOCKS, s, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    for meta, cls in ((prefill, prefill_cls), (decode, decode_cls)):
        q = torch.zeros(meta.num_tokens, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
        run = bind(cls.run, SELF, **fa.run_kwargs(q, pages, pages.clone())).arguments
        k_cache, v_cache = run["paged_kv_cache"]
        assert run["q"].shape[0] == int(meta.qo_indptr[-1])
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()  # decode needs equal strides


def test_every_wrapper_call_in_the_backend_goes_through_the_checked_kwargs():
    """The backend builds its arguments only with flashinfer_args, so the bindings above are its real calls."""
    from lessons.l3_block_tensor.backends import flashinfer_backend

    src = inspect.getsource(flashinfer_backend)
    for call in ("BatchPrefillWithPagedKVCacheWrapper(", "BatchDecodeWithPagedKVCacheWrapper(", ".plan(", ".run("):
        for line in (ln for ln in src.splitlines() if call in ln and not ln.strip().startswith(("#", "def "))):
            assert "**fa." in line, f"a FlashInfer call not built by flashinfer_args: {line.strip()}"
