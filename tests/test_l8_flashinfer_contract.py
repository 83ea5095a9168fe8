"""L8's mixed steps (decode rows and prompt slices in one ragged forward) on every attention path.

1. The FlashInfer contract, without a GPU (skipped where flashinfer is not installed; CI installs it). A mixed
   step built by the real L8 scheduler on the tiny model is not decode-only, so the FlashInfer backend plans
   it on BatchPrefillWithPagedKVCacheWrapper: its plan kwargs (flashinfer_args.prefill_plan_kwargs) bind to
   the installed signature and are the very tensors the torch backend consumes. Per request: the query rows
   are its slice (num_cached .. end-1), the pages are its history up to the slice's end and no further,
   the last page length makes kv_len = end, causal=True. FlashInfer's causal mask is aligned bottom-right
   when kv_len > qo_len: query i sits at position kv_len - qo_len + i and sees keys 0 .. kv_len - qo_len + i
   (its BatchPrefillWithPagedKVCacheWrapper docstring gives the equivalent custom mask,
   tril(diagonal=kv_len - qo_len)). That is exactly shared/attention.py::causal_attention's alignment, and
   a slice's positions are the last qo_len of a history kv_len = end long: so a slice needs no new kernel.

2. Chunk attention against the oracle (never skipped: the README install has no flashinfer). A prompt
   computed in slices, each batched with another request's decode row, through L3's TorchBackend and
   BatchedBackend: each slice's rows equal the same rows of one whole-prompt causal attention over the same
   K/V, and a slice never reads past its end: the pool slots after it (the rest of its last block and the
   blocks reserved beyond) hold garbage, and its output is finite and does not change when the garbage does.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from lessons.l2_token_flat.engine import blocks_for
from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.backends import BatchedBackend, TorchBackend
from lessons.l3_block_tensor.backends import flashinfer_args as fa
from lessons.l3_block_tensor.backends.torch_backend import history_slots
from lessons.l3_block_tensor.batch_meta import BatchMeta
from lessons.l6_prefix_sharing.sequence import SharedSequence
from lessons.l8_chunked_prefill import L8Engine
from lessons.l8_chunked_prefill.slice import Slice
from shared.attention import causal_attention
from shared.generation import StopRule

CPU = torch.device("cpu")
SELF = object()  # stands in for a wrapper instance: constructing one needs a GPU


@pytest.fixture(scope="module")
def flashinfer():
    return pytest.importorskip("flashinfer")


def bind(fn, *args, **kwargs) -> inspect.BoundArguments:
    return inspect.signature(fn).bind(*args, **kwargs)


def slots_of(blocks: list[int], S: int, end: int) -> list[int]:
    """Flat pool slots of positions 0 .. end-1 for a block table: what a history `end` long must read."""
    return [blocks[p // S] * S + p % S for p in range(end)]


# --- 1. the FlashInfer contract of a mixed step ---


@pytest.fixture(scope="module")
def mixed_step(tiny_model):
    """The real L8 engine (torch backend, graphs off), S = 4, budget 16, slices of at most 5. Step 1: A's
    5-token prompt (samples) and C's first 5. Step 2, the mixed step: A's decode, C's slice 5..9 (its
    queries are the last 5 of a 10-token history) and D's fresh first slice 0..4 of 7 (no sample).
    Returns (engine, the rows the scheduler planned: (seq, start, end, decode, blocks), the meta planned)."""
    S = 4
    engine = L8Engine(tiny_model, S, 32, max_running=8, backend="torch", graphs=False,
                      max_batched_tokens=16, max_slice_tokens=5)
    rows, metas = [], []
    schedule, plan = engine.scheduler.schedule, engine.runner.backend.plan

    def recorded_schedule():
        pieces = schedule()
        rows.append([(p.seq, p.num_cached, p.num_tokens, p.decode, list(p.blocks)) for p in pieces])
        return pieces

    def recorded_plan(meta):
        metas.append(meta)
        return plan(meta)

    engine.scheduler.schedule, engine.runner.backend.plan = recorded_schedule, recorded_plan
    a = engine.add_request(list(range(1000, 1005)), StopRule(4))
    c = engine.add_request(list(range(2000, 2020)), StopRule(2))
    engine.step()
    d = engine.add_request(list(range(3000, 3007)), StopRule(2))
    engine.step()
    step = [(seq, start, end, decode, blocks) for seq, start, end, decode, blocks in rows[1]]
    assert [(s.seq_id, start, end, decode) for s, start, end, decode, _ in step] == [
        (a.seq_id, 5, 6, True), (c.seq_id, 5, 10, False), (d.seq_id, 0, 5, False)]
    return engine, step, metas[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_mixed_step_plans_on_the_prefill_wrapper_with_the_torch_backends_metadata(
        flashinfer, tiny_model, mixed_step, dtype):
    from test_l3_flashinfer_contract import check_invariants

    engine, step, meta = mixed_step
    S, cfg = engine.block_size, tiny_model.config
    check_invariants(meta, engine.allocator.num_blocks)
    assert not meta.decode_only, "a step with a prompt slice of several tokens must take the prefill wrapper"
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    kwargs = fa.prefill_plan_kwargs(meta, cfg, dtype)
    plan = bind(wrapper.plan, SELF, **kwargs).arguments
    # The very tensors the torch backend was planned with: not copies, not rebuilt.
    assert plan["qo_indptr"] is meta.qo_indptr and plan["paged_kv_indptr"] is meta.kv_indptr
    assert plan["paged_kv_indices"] is meta.kv_indices and plan["paged_kv_last_page_len"] is meta.kv_last_page_len
    assert plan["causal"] is True and plan["page_size"] == S and plan["pos_encoding_mode"] == "NONE"
    assert plan["q_data_type"] == dtype and plan["kv_data_type"] == dtype

    backend = engine.runner.backend
    assert isinstance(backend, TorchBackend)
    qo, kv = meta.qo_indptr.tolist(), meta.kv_indptr.tolist()
    for b, (seq, start, end, decode, blocks) in enumerate(step):
        pages = blocks_for(end, S)
        assert qo[b + 1] - qo[b] == end - start, f"request {b}: query rows are not its slice"
        assert meta.kv_indices[kv[b]:kv[b + 1]].tolist() == blocks[:pages], f"request {b}: pages past its end"
        kv_len = S * (pages - 1) + int(meta.kv_last_page_len[b])
        assert kv_len == end, f"request {b}: FlashInfer would attend over {kv_len} keys, the slice ends at {end}"
        # Bottom-right: query i of the slice is position kv_len - qo_len + i (RoPE was applied at these).
        assert meta.positions[qo[b]:qo[b + 1]].tolist() == list(range(kv_len - (end - start), kv_len))
        # What the torch backend reads for request b: exactly the history 0 .. end-1, ending at the slice end.
        q0, q1, slots = backend._per_request[b]
        assert (q0, q1) == (qo[b], qo[b + 1])
        assert slots.tolist() == history_slots(meta, b).tolist() == slots_of(blocks, S, end)
        assert meta.slot_mapping[qo[b]:qo[b + 1]].tolist() == slots_of(blocks, S, end)[start:]
    assert int(meta.last_rows[1]) == qo[2] - 1  # C's last row: computed, but C does not sample
    # The step ran: the engine now holds what it computed.
    assert [seq.num_cached for seq, *_ in step] == [6, 10, 5]


def test_flashinfer_documents_the_bottom_right_causal_mask_the_oracle_uses(flashinfer, mixed_step):
    """FlashInfer's prefill wrapper documents causal=True as the custom mask tril(diagonal=kv_len - qo_len);
    for every request of the mixed step that mask gives what causal_attention gives."""
    doc = inspect.getdoc(flashinfer.BatchPrefillWithPagedKVCacheWrapper) or ""
    assert "diagonal=(kv_len[i] - qo_len[i])" in doc, "FlashInfer's documented causal alignment changed: recheck"
    _, _, meta = mixed_step
    g = torch.Generator().manual_seed(0)
    qo = meta.qo_indptr.tolist()
    for b in range(meta.batch_size):
        qo_len, kv_len = qo[b + 1] - qo[b], len(history_slots(meta, b))
        q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((qo_len, 4), (kv_len, 2), (kv_len, 2)))
        mask = torch.tril(torch.full((qo_len, kv_len), True), diagonal=kv_len - qo_len)  # FlashInfer's doc
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(causal_attention(q, k, v), want)


def test_pages_reserved_past_a_slice_end_are_not_in_its_page_table(flashinfer, tiny_model):
    """A request holding blocks for its whole prompt, fed 6..12 of 23: the plan names 4 pages (kv_len 13),
    not the 6 it holds; with a decode row and a one-token slice the step is decode-only, and the decode
    wrapper's kwargs bind with kv_len = each slice's end."""
    S, cfg = 4, tiny_model.config
    seq = SharedSequence(list(range(23)), S, blocks=[9, 2, 14, 5, 11, 0], num_cached=6)
    piece = Slice.of(seq, 7)
    meta = BatchMeta.build([Request(list(range(5)), S, blocks=[7, 3], num_cached=4), piece], S, CPU)
    assert meta.kv_indices.tolist() == [7, 3, 9, 2, 14, 5] and meta.kv_last_page_len.tolist() == [1, 1]
    bind(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan, SELF, **fa.prefill_plan_kwargs(meta, cfg, torch.float16))
    assert history_slots(meta, 1).tolist() == slots_of(seq.blocks, S, 13)

    one = Slice.of(seq, 1)  # a budget's last token: a one-token prompt slice
    meta = BatchMeta.build([Request(list(range(5)), S, blocks=[7, 3], num_cached=4), one], S, CPU)
    assert meta.decode_only, "decode rows and one-token slices: the decode kernel runs the step"
    kwargs = fa.decode_plan_kwargs(meta, cfg, torch.bfloat16)
    bind(flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan, SELF, **kwargs)
    impl = bind(flashinfer.BatchDecodeWithPagedKVCacheWrapper._plan_impl, SELF, **kwargs).arguments
    assert impl["indices"] is meta.kv_indices and impl["indices"].tolist() == [7, 3, 9, 2]
    assert impl["last_page_len"].tolist() == [1, 3]  # kv_len 5 and 7: each row sees its whole history


# --- 2. chunk attention against the oracle (no flashinfer needed) ---

HQ, HKV, D, S, NUM_BLOCKS, L = 4, 2, 16, 4, 16, 23
TABLE = [9, 2, 14, 5, 11, 0]  # the prompt's blocks, reserved whole: 6 blocks for 23 tokens
OTHER, OTHER_TABLE = 10, [7, 3, 12]  # another request, decoding its position 9 in every step


def chunks(sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    assert start == L
    return out


CHUNKINGS = {
    "whole": [23],
    "5s": [5, 5, 5, 5, 3],  # ends mid-block
    "blocks": [4, 4, 4, 4, 4, 3],  # ends on block boundaries
    "ragged": [3, 9, 1, 1, 7, 2],  # one-token slices part-way through the prompt
    "ones": [1] * 23,
}


def write(cache: torch.Tensor, table: list[int], start: int, end: int, values: torch.Tensor) -> None:
    flat = cache.view(-1, HKV, D)
    flat[torch.tensor(slots_of(table, S, end)[start:])] = values[start:end]


@pytest.mark.parametrize("backend_cls", [TorchBackend, BatchedBackend])
@pytest.mark.parametrize("name", list(CHUNKINGS))
def test_a_prompt_in_slices_attends_as_the_whole_prompt(backend_cls, name):
    g = torch.Generator().manual_seed(1)
    q_all, k_all, v_all = (torch.randn(n, h, D, generator=g) for n, h in ((L, HQ), (L, HKV), (L, HKV)))
    q_o, k_o, v_o = (torch.randn(n, h, D, generator=g) for n, h in ((1, HQ), (OTHER, HKV), (OTHER, HKV)))
    whole = causal_attention(q_all, k_all, v_all)  # the oracle: one causal attention over the whole prompt
    other_want = causal_attention(q_o, k_o, v_o)

    # Slots never written hold garbage. The oracle and the prefill path gather only a history's own slots, so
    # NaN there must never reach them; BatchedBackend's decode path (one query row: the other request's
    # decode, and a one-token slice) gathers whole pages and masks the slots past kv_len, so it gets huge
    # finite garbage (the pool starts zeroed and only ever holds finite K/V, never NaN).
    garbage = float("nan") if backend_cls is TorchBackend else 1e30
    k_cache = torch.full((NUM_BLOCKS, S, HKV, D), garbage)
    v_cache = torch.full((NUM_BLOCKS, S, HKV, D), -garbage)
    write(k_cache, OTHER_TABLE, 0, OTHER, k_o)
    write(v_cache, OTHER_TABLE, 0, OTHER, v_o)

    seq = SharedSequence(list(range(L)), S, blocks=list(TABLE))
    backend, rows = backend_cls(), []
    for start, end in chunks(CHUNKINGS[name]):
        assert seq.num_cached == start
        piece = Slice.of(seq, end - start)
        # As the runner does: the step writes its new K/V first, then attends. Slots past `end` stay garbage.
        write(k_cache, TABLE, start, end, k_all)
        write(v_cache, TABLE, start, end, v_all)
        decode = Request(list(range(OTHER)), S, blocks=OTHER_TABLE, num_cached=OTHER - 1)
        meta = BatchMeta.build([decode, piece], S, CPU)  # decodes first, as the scheduler orders a step
        assert len(history_slots(meta, 1)) == end, "the slice's history does not end at its end"
        q = torch.cat([q_o, q_all[start:end]])
        backend.plan(meta)
        out = backend.run(q, k_cache, v_cache, meta)
        assert torch.isfinite(out).all(), f"slice {start}..{end}: garbage past the end leaked into the output"
        # assert_close's fp32 defaults (atol 1e-5, rtol 1.3e-6): measured 3.6e-7 (Intel Xeon AMX; torch capped to
        # AVX2 the same), 1.3e-7 for the decode row: 30x margin
        torch.testing.assert_close(out[1:], whole[start:end], msg=f"slice {start}..{end} differs from the whole prompt")
        torch.testing.assert_close(out[:1], other_want)

        # Different garbage past the end (the rest of the slice's last block, and the blocks reserved beyond
        # it): the output must not move by one bit.
        tail = slots_of(TABLE, S, len(TABLE) * S)[end:]
        if tail:
            k_flat, v_flat = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
            saved_k, saved_v = k_flat[tail].clone(), v_flat[tail].clone()
            k_flat[tail], v_flat[tail] = torch.randn(len(tail), HKV, D, generator=g) * 1e4, -7.0
            backend.plan(meta)
            assert torch.equal(backend.run(q, k_cache, v_cache, meta), out), f"slice {start}..{end} read past its end"
            k_flat[tail], v_flat[tail] = saved_k, saved_v
        rows.append(out[1:])
        seq.num_cached = end  # what the engine copies back after the step
    torch.testing.assert_close(torch.cat(rows), whole)
