"""BlockAllocator: lifecycle, reuse of freed blocks, exhaustion leaving the pool consistent."""
import pytest

from lessons.l2_token_flat.block_allocator import BlockAllocator
from lessons.l2_token_flat.request import Request
from shared.errors import PoolExhausted


@pytest.mark.task("L2.1")
def test_alloc_and_free_round_trip():
    a = BlockAllocator(8)
    got = a.alloc(3)
    assert len(set(got)) == 3 and all(0 <= b < 8 for b in got)
    assert a.num_free == 5
    a.free(got)
    assert a.num_free == 8


@pytest.mark.task("L2.1")
def test_freed_blocks_are_reused():
    a = BlockAllocator(4)
    first = a.alloc(4)
    a.free(first[:2])
    again = a.alloc(2)
    assert sorted(again) == sorted(first[:2])
    assert a.num_free == 0


@pytest.mark.task("L2.1")
def test_exhaustion_names_needed_and_free_and_changes_nothing():
    a = BlockAllocator(5)
    held = a.alloc(3)
    with pytest.raises(PoolExhausted, match=r"need 4 block\(s\), 2 of 5 free"):
        a.alloc(4)
    assert a.num_free == 2  # all or nothing: no partial allocation
    rest = a.alloc(2)
    assert sorted(held + rest) == list(range(5))


@pytest.mark.task("L2.2")
def test_reserve_failure_leaves_request_and_pool_intact():
    a = BlockAllocator(3)
    req = Request([1] * 10, block_size=4)
    req.reserve(10, a)  # 3 blocks
    blocks = list(req.blocks)
    with pytest.raises(PoolExhausted):
        req.reserve(13, a)
    assert req.blocks == blocks and a.num_free == 0
    a.free(req.blocks)
    assert a.num_free == 3


@pytest.mark.task("L2.1")
def test_double_free_is_caught():
    a = BlockAllocator(2)
    b = a.alloc(1)
    a.free(b)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(b)
    assert a.num_free == 2


@pytest.mark.parametrize("bad, error", [([0, 0], "freed twice"), ([-1], "not in this pool"),
                                        ([4], "not in this pool"), ([1, 4], "not in this pool")])
@pytest.mark.task("L2.1")
def test_free_rejects_repeats_and_out_of_range_ids_and_changes_nothing(bad, error):
    a = BlockAllocator(4)
    a.alloc(2)  # blocks 0 and 1 held; 2 and 3 free (so -1, read as block 3, looked free before the fix)
    with pytest.raises(ValueError, match=error):
        a.free(bad)
    assert a.num_free == 2 and a.alloc(2) == [2, 3]  # nothing was freed, not even the valid ids


@pytest.mark.task("L2.1")
def test_a_freed_block_is_reused_last():
    a = BlockAllocator(4)
    a.alloc(3)  # 0, 1, 2
    a.free([1, 0])
    # The never-used 3 comes first, then the freed ones in the order they were freed.
    assert a.alloc(3) == [3, 1, 0]
