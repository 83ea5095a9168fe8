"""reserve() and slot math at block boundaries: slot = block * S + offset, for S = 1, 7 and 16."""
import pytest
import torch

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.forward_meta import ForwardMeta
from lessons.l2_token_flat.request import Request

BLOCK_SIZES = [1, 7, 16]


def lengths(s: int) -> list[int]:
    return sorted({1, max(1, s - 1), s, s + 1, 5 * s + 3})


@pytest.mark.task("L2.2")
@pytest.mark.parametrize("s", BLOCK_SIZES)
def test_reserve_allocates_exactly_ceil_blocks(s):
    for n in lengths(s):
        a = BlockAllocator(64)
        req = Request([0] * n, block_size=s)
        req.reserve(n, a)
        assert len(req.blocks) == -(-n // s), f"{n} tokens in blocks of {s} need {-(-n // s)} blocks, got {req.blocks}"
        assert a.num_free == 64 - len(req.blocks)


@pytest.mark.task("L2.2")
@pytest.mark.parametrize("s", BLOCK_SIZES)
def test_reserve_grows_only_when_a_block_fills(s):
    a = BlockAllocator(64)
    req = Request([0], block_size=s)
    seen = []
    for n in range(1, 3 * s + 2):
        req.reserve(n, a)
        seen.append(len(req.blocks))
    # A new block appears exactly at token counts 1, s+1, 2s+1, ...
    assert [n for n, (prev, cur) in enumerate(zip([0] + seen, seen), start=1) if cur > prev] == list(
        range(1, 3 * s + 2, s)
    )


@pytest.mark.task("L2.3")
@pytest.mark.parametrize("s", BLOCK_SIZES)
def test_slots_are_block_times_size_plus_offset(s):
    a = BlockAllocator(64)
    a.alloc(3)  # so the request's blocks are not 0, 1, 2 ...
    for n in lengths(s):
        req = Request([0] * n, block_size=s)
        req.reserve(n, a)
        slots = req.slots(0, n)
        for pos, slot in enumerate(slots):
            want = req.blocks[pos // s] * s + pos % s
            assert slot == want, (f"S={s}, block table {req.blocks}: position {pos} is offset {pos % s} of block "
                                  f"{req.blocks[pos // s]}, slot {want}; got {slot}")
            assert slot // s in req.blocks
        assert len(set(slots)) == n
        a.free(req.blocks)


@pytest.mark.task("L2.4")
@pytest.mark.parametrize("s", BLOCK_SIZES)
def test_forward_meta_prefill_then_decode(s):
    a = BlockAllocator(64)
    n = s + 1  # prompt crosses one boundary
    req = Request(list(range(n)), block_size=s)
    req.reserve(n, a)
    meta = ForwardMeta.for_step(req, torch.device("cpu"))
    assert meta.is_prefill
    assert meta.positions.tolist() == list(range(n))
    assert meta.slot_mapping.tolist() == meta.kv_indices.tolist() == req.slots(0, n)
    req.num_cached = n
    req.output_ids.append(7)
    req.reserve(req.num_tokens, a)
    meta = ForwardMeta.for_step(req, torch.device("cpu"))
    assert not meta.is_prefill
    assert meta.positions.tolist() == [n]
    assert meta.slot_mapping.tolist() == [req.slot(n)]
    assert meta.kv_indices.tolist() == req.slots(0, n + 1)
    assert meta.kv_indices.dtype == torch.int64
