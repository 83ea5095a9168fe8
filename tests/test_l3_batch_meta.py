"""BatchMeta: the CSR page tables and slot mapping of one step, at and around page boundaries."""
from __future__ import annotations

import pytest
import torch

from lessons.l2_token_flat.request import Request
from lessons.l3_block_tensor.batch_meta import BatchMeta

CPU = torch.device("cpu")


def req(num_tokens: int, num_cached: int, blocks: list[int], block_size: int) -> Request:
    """A request whose history is num_tokens long, num_cached of them already in the pool."""
    return Request(prompt_ids=list(range(num_tokens)), block_size=block_size, blocks=blocks, num_cached=num_cached)


@pytest.mark.task("L3.2")
def test_worked_example_from_the_doc():
    # docs/l3_block_tensor.md: S = 4; A prefills 5 tokens, B decodes its 8th, C prefills 3 (one block spare).
    s = 4
    a, b, c = req(5, 0, [12, 5], s), req(8, 7, [3, 7], s), req(3, 0, [0, 6], s)
    m = BatchMeta.build([a, b, c], s, CPU)
    assert m.qo_indptr.tolist() == [0, 5, 6, 9], "qo_indptr: A's rows 0..4, B's row 5, C's rows 6..8"
    assert m.kv_indptr.tolist() == [0, 2, 4, 5], "kv_indptr: A's 2 pages, B's 2, C's 1"
    # C's spare block 6 is not part of its history
    assert m.kv_indices.tolist() == [12, 5, 3, 7, 0], "kv_indices: the pages each history fills, never a spare block"
    # 5 = 4 + 1; 8 = 4 + 4 (a full page is S, not 0)
    assert m.kv_last_page_len.tolist() == [1, 4, 3], "kv_last_page_len: in 1 .. S, B's full last page counts S = 4"
    assert m.last_rows.tolist() == [4, 5, 8], "last_rows: each request's last new row"
    assert m.positions.tolist() == [0, 1, 2, 3, 4, 7, 0, 1, 2], "positions: A's 0..4, B's 7, C's 0..2"
    # B's position 7: 7 * 4 + 3
    assert m.slot_mapping.tolist() == [48, 49, 50, 51, 20, 31, 0, 1, 2], "slot_mapping: blocks[pos // S] * S + pos % S"
    assert not m.decode_only, "A and C feed several tokens: not decode_only"
    assert (m.batch_size, m.num_tokens) == (3, 9)


@pytest.mark.task("L3.2")
def test_dtypes_and_devices():
    m = BatchMeta.build([req(3, 0, [1], 4)], 4, CPU)
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    for t in (m.positions, m.slot_mapping, m.last_rows):
        assert t.dtype == torch.int64


@pytest.mark.task("L3.2")
@pytest.mark.parametrize("s", [1, 7, 16])
@pytest.mark.parametrize("decode", [True, False])
def test_page_boundaries(s: int, decode: bool):
    """Histories of 1, S-1, S, S+1, 3S, 3S+1 tokens: page count, last_page_len and every slot."""
    lengths = sorted({n for n in (1, s - 1, s, s + 1, 3 * s, 3 * s + 1) if n >= 1})
    blocks_pool = torch.randperm(64, generator=torch.Generator().manual_seed(s)).tolist()
    reqs, expect_last, cursor = [], [], 0
    for n in lengths:
        pages = -(-n // s)
        blocks = blocks_pool[cursor: cursor + pages + 1]  # one block more than needed: reserved ahead
        cursor += pages + 1
        reqs.append(req(n, n - 1 if decode else 0, blocks, s))
        expect_last.append(n - s * (pages - 1))
    m = BatchMeta.build(reqs, s, CPU)
    assert m.kv_last_page_len.tolist() == expect_last
    assert all(1 <= x <= s for x in expect_last)
    for b, (r, n) in enumerate(zip(reqs, lengths)):
        pages = m.kv_indices[m.kv_indptr[b]: m.kv_indptr[b + 1]].tolist()
        assert pages == r.blocks[: -(-n // s)]
        if n % s == 0:
            assert m.kv_last_page_len[b] == s
        if n % s == 1 or s == 1:
            assert m.kv_last_page_len[b] == 1
    feeds = [(n - 1, n) if decode else (0, n) for n in lengths]
    want_slots = [r.blocks[p // s] * s + p % s for r, (lo, hi) in zip(reqs, feeds) for p in range(lo, hi)]
    assert m.slot_mapping.tolist() == want_slots
    assert m.positions.tolist() == [p for lo, hi in feeds for p in range(lo, hi)]
    assert m.decode_only == decode


@pytest.mark.task("L3.2")
def test_one_token_prompts_are_a_decode_shaped_step():
    m = BatchMeta.build([req(1, 0, [4], 16), req(1, 0, [2], 16)], 16, CPU)
    assert m.decode_only and m.qo_indptr.tolist() == [0, 1, 2] and m.kv_last_page_len.tolist() == [1, 1]


@pytest.mark.task("L3.2")
@pytest.mark.parametrize("bad", [
    lambda: [req(5, 0, [1], 4)],  # 5 tokens need 2 blocks of 4
    lambda: [req(5, 5, [1, 2], 4)],  # nothing new to feed
    lambda: [],
])
def test_bookkeeping_bugs_are_refused(bad):
    with pytest.raises(ValueError):
        BatchMeta.build(bad(), 4, CPU)
