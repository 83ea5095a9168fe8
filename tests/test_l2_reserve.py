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
        want = -(-n // s)
        assert len(req.blocks) == want, (
            f"reserve({n}) at S={s} must cover {n} token(s) with {want} block(s) (ceil), got {len(req.blocks)}: "
            f"{req.blocks}")
        assert a.num_free == 64 - len(req.blocks), (f"reserve({n}) at S={s} holds {len(req.blocks)} blocks, yet the "
                                                    f"allocator has {a.num_free} of 64 free")


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
    grew = [n for n, (prev, cur) in enumerate(zip([0] + seen, seen), start=1) if cur > prev]
    assert grew == list(range(1, 3 * s + 2, s)), (
        f"S={s}: reserve(n) for n = 1, 2, ... must add a block exactly when n reaches 1, S+1, 2S+1, ... (ceil); "
        f"it added one at n = {grew}")


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
            assert slot // s in req.blocks, (
                f"S={s}: slot {slot} of position {pos} lies in block {slot // s}, not in the table {req.blocks}")
        assert len(set(slots)) == n, (
            f"S={s}: {n} positions share {len(set(slots))} slots: two positions would overwrite each other")
        a.free(req.blocks)


@pytest.mark.task("L2.4")
@pytest.mark.parametrize("s", BLOCK_SIZES)
def test_forward_meta_prefill_then_decode(s):
    a = BlockAllocator(64)
    a.alloc(3)  # so the request's blocks are not 0, 1, ... and a slot is not its position
    n = s + 1  # prompt crosses one boundary
    req = Request(list(range(n)), block_size=s)
    req.reserve(n, a)
    meta = ForwardMeta.for_step(req, torch.device("cpu"))
    where = f"S={s}, block table {req.blocks}, the {n}-token prefill"
    assert meta.is_prefill, f"{where}: is_prefill is False, but num_cached is 0"
    assert meta.positions.tolist() == list(range(n)), f"{where}: positions {meta.positions.tolist()}, want 0..{n - 1}"
    assert meta.slot_mapping.tolist() == req.slots(0, n), (
        f"{where}: slot_mapping {meta.slot_mapping.tolist()}, want the slots of positions 0..{n - 1}, "
        f"{req.slots(0, n)}")
    assert meta.kv_indices.tolist() == req.slots(0, n), (
        f"{where}: kv_indices {meta.kv_indices.tolist()}, want the slots of the whole history 0..{n - 1}, "
        f"{req.slots(0, n)}")
    req.num_cached = n
    req.output_ids.append(7)
    req.reserve(req.num_tokens, a)
    meta = ForwardMeta.for_step(req, torch.device("cpu"))
    where = f"S={s}, block table {req.blocks}, the decode of position {n} after {n} cached"
    assert not meta.is_prefill, f"{where}: is_prefill is True, but num_cached is {n}"
    assert meta.positions.tolist() == [n], f"{where}: positions {meta.positions.tolist()}, want [{n}] (absolute)"
    assert meta.slot_mapping.tolist() == [req.slot(n)], (
        f"{where}: slot_mapping {meta.slot_mapping.tolist()}, want only the new token's slot [{req.slot(n)}]")
    assert meta.kv_indices.tolist() == req.slots(0, n + 1), (
        f"{where}: kv_indices {meta.kv_indices.tolist()}, want the slots of the whole history 0..{n} (new token "
        f"included), {req.slots(0, n + 1)}")
    for name in ("positions", "slot_mapping", "kv_indices"):
        assert getattr(meta, name).dtype == torch.int64, f"{name} is {getattr(meta, name).dtype}, want torch.int64"
